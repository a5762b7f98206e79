"""Oracle: libdflash's optimizer step (global-norm clipping, AdamW, cosine
schedule with warm-up) vs torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW
+ LambdaLR with Hugging Face's cosine-with-warm-up rule (and its linear and
constant-with-warm-up rules for lr_schedule DFLASH_LR_LINEAR / _CONSTANT).

1. Isolated: at every step torch gets the C trainer's own parameters and
   gradients and takes one float32 step; the updated parameters must agree
   to 2e-6 relative (float32 update arithmetic; both sides follow the same
   operation order, the remaining difference is the norm's summation order).
2. End to end: 8 steps of two-sequence batches through the float64 PyTorch
   drafter + AdamW; the loss trajectories must agree to 1e-4 relative (the
   C side is float32 throughout; Adam normalises updates, so float32 noise
   in tiny gradients reaches the parameters at ~1e-5).
3. The same with position_weighting DFLASH_POSITION_WEIGHTING_ADAPTIVE, the weights
   computed here from the float64 drafter's own CE (adaptive_loss).
4. optimizer DFLASH_OPTIMIZER_MUON, isolated as in 1 (both adjust_lr rules) and end to end as
   in 2: MuonRef below on the matrices (fc, q/k/v/o, gate/up/down), torch's AdamW on the
   norms. MuonRef is torch.optim.Muon (torch 2.11; CI's torch 2.5.1 has none) written here
   from its algorithm: buf.lerp_(g, 1 - mu); u = g.lerp(buf, mu); Newton-Schulz (3.4445,
   -4.7750, 2.0315) x 5 on u / max(|u|_F, 1e-7), transposed when rows > cols; p *= 1 - lr wd;
   p -= lr * (0.2 sqrt(max(rows, cols)) or sqrt(max(1, rows / cols))) * O. torch runs the
   iterations in bfloat16, libdflash in float32; MuonRef takes the dtype. Where torch has
   torch.optim.Muon (>= 2.9) versus_torch_muon checks MuonRef in bfloat16 against it; run
   by hand with torch 2.11 (/work/main/.venv-peers/bin/python, 2026-12-04; 8 steps, shapes
   32x64, 32x32, 16x32, 48x32, 32x48, both rules): max |difference| of the parameters and
   momentum buffers 0.0 (bit-identical).
Exit 77 when torch is missing.
"""
import math
import sys

from oracle_env import np, torch  # noqa: E402  (numpy, torch or exit 77; the paths)
import torch_drafter as ref  # noqa: E402
from oracle_model import make_config, random_params  # noqa: E402
from libdflash.train import Trainer  # noqa: E402

OPT = dict(lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8, grad_clip=0.5,
           warmup_ratio=0.25, total_steps=8, min_lr_ratio=0.0)


def hf_cosine(warmup, total):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return f


def hf_linear(warmup, total):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


def hf_constant(warmup, total):
    return lambda step: step / max(1, warmup) if step < warmup else 1.0


# lr_schedule (dflash_lr_schedule) -> Hugging Face's rule
SCHEDULES = {0: hf_cosine, 1: hf_linear, 2: hf_constant}


def adaptive_loss(cfg, P, embed, lm_head, ids, mask, hidden, anchors):
    """sum(w * CE) and the supervised rows: each supervised block position weighted by the
    product of exp(-CE) (not differentiated) of the block's earlier supervised positions,
    each block's weights rescaled to sum to its supervised positions."""
    B = ref.block_size(cfg)
    hf = ref.final_hidden(cfg, P, embed, ids, hidden, anchors)
    w0, lp = ref.position_weights(cfg, mask, anchors, -1.0)  # 1 where supervised
    ce = torch.nn.functional.cross_entropy(hf @ lm_head.T, ids[lp].long(), reduction="none")
    w = torch.zeros_like(ce)
    for n in range(len(anchors)):
        rows = [n * B + k for k in range(B) if w0[n * B + k] > 0]
        reach, raw = 1.0, []
        for r in rows:
            raw.append(reach)
            reach *= math.exp(-ce[r].item())
        for r, x in zip(rows, raw):
            w[r] = x * len(rows) / sum(raw)
    return (w * ce).sum(), float(w0.sum())


NS_COEFFS, NS_STEPS, NS_EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7


def newton_schulz(u, dtype):
    a, b, c = NS_COEFFS
    x = u.to(dtype)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(NS_STEPS):  # addmm as torch's, so that bfloat16 rounds the same
        g = x @ x.T
        x = torch.addmm(x, torch.addmm(g, g, g, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(u.dtype)


class MuonRef(torch.optim.Optimizer):
    """torch.optim.Muon's single-tensor step (Nesterov), ns_dtype for the iterations."""

    def __init__(self, params, lr, weight_decay=0.1, momentum=0.95, adjust="match_rms_adamw",
                 ns_dtype=torch.float32):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))
        self.adjust, self.ns_dtype = adjust, ns_dtype

    @torch.no_grad()
    def step(self):
        for grp in self.param_groups:
            lr, wd, mu = grp["lr"], grp["weight_decay"], grp["momentum"]
            for p in grp["params"]:
                st = self.state[p]
                buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - mu)
                o = newton_schulz(p.grad.lerp(buf, mu), self.ns_dtype)
                A, B = p.shape
                k = 0.2 * math.sqrt(max(A, B)) if self.adjust == "match_rms_adamw" \
                    else math.sqrt(max(1, A / B))
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-lr * k)


MUON = dict(optimizer=1, muon_momentum=0.9, muon_weight_decay=0.2)
ADJUST = {0: "match_rms_adamw", 1: "original"}  # dflash_muon_adjust_lr


def muon_optimizers(named, warmup, adjust=0):
    """speculators' split: 2-D with both sides > 1 and no vocabulary-sized codebook to Muon,
    the rest to AdamW; one schedule."""
    def takes(n, p):
        return p.ndim == 2 and min(p.shape) > 1 and "codebook" not in n
    mats = [p for n, p in named if takes(n, p)]
    rest = [p for n, p in named if not takes(n, p)]
    rule = SCHEDULES[0](warmup, OPT["total_steps"])
    muon = MuonRef(mats, OPT["lr"], MUON["muon_weight_decay"], MUON["muon_momentum"],
                   ADJUST[adjust], ns_dtype=mats[0].dtype)
    adam = torch.optim.AdamW(rest, lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]),
                             eps=OPT["adam_eps"], weight_decay=OPT["weight_decay"], foreach=False)
    return [(o, torch.optim.lr_scheduler.LambdaLR(o, rule)) for o in (muon, adam)], len(mats)


def torch_loss(cfg, tp, E, W, data, gamma, adaptive=False):
    """The float64 reference's loss of one step over `data`: each sequence's weighted CE
    (position weights: the gamma decay, or the adaptive ones), normalised by the weight sum
    as the trainer does."""
    num, den = 0.0, 0.0
    for ids, m, h, a in data:
        ids_t, m_t, h_t = torch.tensor(ids), torch.tensor(m), torch.tensor(h, dtype=torch.float64)
        if adaptive:
            l, n = adaptive_loss(cfg, tp, E, W, ids_t, m_t, h_t, a)
            num, den = num + l, den + n
            continue
        w, _ = ref.position_weights(cfg, m_t, a, gamma)
        num = num + ref.loss_fn(cfg, tp, E, W, ids_t, m_t, h_t, a, gamma) * w.sum()
        den += w.sum().item()
    return num / den


def same_losses(losses_c, losses_t):
    """(whether the trainer's losses are within 1e-4 relative of torch's, the worst)."""
    errs = [abs(a - b) / abs(b) for a, b in zip(losses_c, losses_t)]
    print("   C     losses:", " ".join(f"{x:.6f}" for x in losses_c))
    print("   torch losses:", " ".join(f"{x:.6f}" for x in losses_t))
    return max(errs) <= 1e-4, max(errs)


def same_params(tr, tp, names, tol, step, worst):
    """Compare the trainer's parameters with torch's (relative to each tensor's largest
    magnitude), then continue torch from the trainer's so errors do not compound."""
    pc = tr.parameters()
    for n in names:
        ref_p = tp[n].detach().numpy()
        e = float(np.max(np.abs(pc[n] - ref_p)) / np.max(np.abs(ref_p)))
        worst = max(worst, e)
        if e > tol:
            print(f"FAIL step {step}: {n} rel err {e:.2e}")
            return False, worst
        tp[n].data = torch.tensor(pc[n])
    return True, worst


def isolated_muon(cfg, embed, lm_head, P, data, adjust):
    worst, warm = 0.0, int(OPT["warmup_ratio"] * OPT["total_steps"])
    with Trainer(cfg, embed, lm_head, n_threads=2, muon_adjust_lr=adjust, **MUON, **OPT) as tr:
        tr.set_parameters(P)
        names = tr.names()
        tp = {n: torch.tensor(P[n], requires_grad=True) for n in names}
        opts, n_mats = muon_optimizers(list(tp.items()), warm, adjust)
        assert n_mats == 1 + 7 * cfg["num_hidden_layers"], n_mats  # fc + 7 per layer
        for step in range(OPT["total_steps"]):
            c_step(tr, data)
            grads = tr.gradients()
            for n in names:
                tp[n].grad = torch.tensor(grads[n])
            torch.nn.utils.clip_grad_norm_(list(tp.values()), OPT["grad_clip"])
            for o, sched in opts:
                o.step()
                sched.step()
            tr.step()
            ok, worst = same_params(tr, tp, names, 1e-5, step, worst)
            if not ok:
                return False, worst
    return True, worst


def versus_torch_muon():
    """MuonRef (bfloat16 iterations) against torch.optim.Muon: the largest difference."""
    gen = torch.Generator().manual_seed(0)
    shapes, worst = [(32, 64), (32, 32), (16, 32), (48, 32), (32, 48)], 0.0
    for adjust in ("match_rms_adamw", "original"):
        a = [0.1 * torch.randn(s, generator=gen) for s in shapes]
        b = [x.clone() for x in a]
        mine = MuonRef(a, 3e-3, 0.2, 0.9, adjust, ns_dtype=torch.bfloat16)
        theirs = torch.optim.Muon(b, lr=3e-3, weight_decay=0.2, momentum=0.9, adjust_lr_fn=adjust)
        for _ in range(8):
            for p, q in zip(a, b):
                p.grad = torch.randn(p.shape, generator=gen)
                q.grad = p.grad.clone()
            mine.step()
            theirs.step()
        for p, q in zip(a, b):
            bufs = mine.state[p]["momentum_buffer"] - theirs.state[q]["momentum_buffer"]
            worst = max(worst, (p - q).abs().max().item(), bufs.abs().max().item())
    return worst


def make_data(cfg, rng, n_seq=2, S=36):
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    data = []
    for _ in range(n_seq):
        ids = rng.integers(0, V - 1, size=S).astype(np.int32)
        mask = np.ones(S, dtype=np.uint8)
        mask[:5] = 0
        hid = rng.standard_normal((S, K * H)).astype(np.float32)
        anchors = np.sort(rng.choice(np.arange(4, S - 2), size=5, replace=False)).astype(np.int32)
        data.append((ids, mask, hid, anchors))
    return data


def c_step(tr, data):
    total_w = sum(tr.weight_sum(m, a) for _, m, _, a in data)
    tr.zero_grad()
    for ids, m, h, a in data:
        tr.accumulate(ids, m, a, 1.0 / total_w, hidden=h)
    lsum, _ = tr.collect()
    return lsum / total_w


def torch_optimizer(params, warmup, schedule=0):
    opt = torch.optim.AdamW(params, lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]),
                            eps=OPT["adam_eps"], weight_decay=OPT["weight_decay"], foreach=False)
    rule = SCHEDULES[schedule](warmup, OPT["total_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, rule)
    return opt, sched


def isolated(cfg, embed, lm_head, P, data, schedule=0):
    worst = 0.0
    with Trainer(cfg, embed, lm_head, n_threads=2, lr_schedule=schedule, **OPT) as tr:
        tr.set_parameters(P)
        names = tr.names()
        tp = {n: torch.tensor(P[n], requires_grad=True) for n in names}
        opt, sched = torch_optimizer(list(tp.values()), int(OPT["warmup_ratio"] * OPT["total_steps"]),
                                     schedule)
        for step in range(OPT["total_steps"]):
            c_step(tr, data)
            grads = tr.gradients()
            with torch.no_grad():
                for n in names:
                    tp[n].grad = torch.tensor(grads[n])
            norm_t = torch.nn.utils.clip_grad_norm_(list(tp.values()), OPT["grad_clip"]).item()
            lr_t = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            norm_c, lr_c = tr.step()
            if abs(lr_c - lr_t) > 1e-12 * max(1.0, lr_t):
                print(f"FAIL step {step}: lr {lr_c} vs torch {lr_t}")
                return False, worst
            if abs(norm_c - norm_t) > 1e-5 * norm_t:
                print(f"FAIL step {step}: grad norm {norm_c} vs torch {norm_t}")
                return False, worst
            ok, worst = same_params(tr, tp, names, 2e-6, step, worst)
            if not ok:
                return False, worst
    return True, worst


def end_to_end(cfg, embed, lm_head, P, data, gamma, adaptive=False, muon=False):
    """Train the C trainer and the float64 PyTorch drafter side by side (AdamW, or Muon on the
    matrices with AdamW on the rest) and compare the losses of every step."""
    losses_c, losses_t = [], []
    with Trainer(cfg, embed, lm_head, n_threads=2, loss_gamma=gamma,
                 position_weighting=int(adaptive), **(MUON if muon else {}), **OPT) as tr:
        tr.set_parameters(P)
        for _ in range(OPT["total_steps"]):
            losses_c.append(c_step(tr, data))
            tr.step()
    tp = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in P.items()}
    warmup = int(OPT["warmup_ratio"] * OPT["total_steps"])
    opts = muon_optimizers(list(tp.items()), warmup)[0] if muon else \
        [torch_optimizer(list(tp.values()), warmup)]
    E = torch.tensor(embed, dtype=torch.float64)
    W = torch.tensor(lm_head, dtype=torch.float64)
    for _ in range(OPT["total_steps"]):
        for p in tp.values():
            p.grad = None
        loss = torch_loss(cfg, tp, E, W, data, gamma, adaptive)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(tp.values()), OPT["grad_clip"])
        for o, sched in opts:
            o.step()
            sched.step()
        losses_t.append(loss.item())
    return same_losses(losses_c, losses_t)


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(7)
    cfg = make_config(H=32, I=48, L=2, nh=4, nkv=2, d=8, V=89, B=4, K=2)
    embed = rng.standard_normal((89, 32)).astype(np.float32)
    lm_head = (0.5 * rng.standard_normal((89, 32))).astype(np.float32)
    P = random_params(cfg, rng)
    data = make_data(cfg, rng)
    passed, total = 0, 0
    for schedule, name in ((0, "cosine"), (1, "linear"), (2, "constant")):
        ok, worst = isolated(cfg, embed, lm_head, P, data, schedule)
        print(f"{'ok' if ok else 'FAIL'} isolated AdamW+clip+{name}, {OPT['total_steps']} "
              f"steps: worst parameter rel err {worst:.2e}")
        passed, total = passed + ok, total + 1
    for adaptive, name in ((False, "gamma 3"), (True, "adaptive weights")):
        ok, worst = end_to_end(cfg, embed, lm_head, P, data, 3.0, adaptive)
        print(f"{'ok' if ok else 'FAIL'} end-to-end training ({name}), {OPT['total_steps']} "
              f"steps: worst loss rel err {worst:.2e}")
        passed, total = passed + ok, total + 1
    for adjust in (0, 1):
        ok, worst = isolated_muon(cfg, embed, lm_head, P, data, adjust)
        print(f"{'ok' if ok else 'FAIL'} isolated Muon ({ADJUST[adjust]})+AdamW+clip+cosine, "
              f"{OPT['total_steps']} steps: worst parameter rel err {worst:.2e}")
        passed, total = passed + ok, total + 1
    if hasattr(torch.optim, "Muon"):
        worst = versus_torch_muon()
        ok = worst <= 1e-6
        print(f"{'ok' if ok else 'FAIL'} MuonRef (bfloat16) vs torch.optim.Muon of torch "
              f"{torch.__version__}: max abs difference {worst:.2e}")
        passed, total = passed + ok, total + 1
    else:
        print(f"note: torch {torch.__version__} has no torch.optim.Muon; MuonRef alone")
    ok, worst = end_to_end(cfg, embed, lm_head, P, data, 3.0, muon=True)
    print(f"{'ok' if ok else 'FAIL'} end-to-end training (Muon, gamma 3), {OPT['total_steps']} "
          f"steps: worst loss rel err {worst:.2e}")
    passed, total = passed + ok, total + 1
    print(f"{passed} passed, {total - passed} failed")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
