"""Oracle: the evaluation of a DSpark drafter (dflash_trainer_eval_walk, `dflash eval`) against
a float64 PyTorch computation written from spec/dspark.md sections 1, 2 and 6, on the same
random checkpoint and held-out data (a store written with the target's final state):

- the greedy walk as llama.cpp, vLLM and SGLang draft at T = 0: d_0 = argmax z_0 with the
  Markov head on the anchor x_a, d_k = argmax z_k on d_{k-1} (the chain's own argmax), B
  drafts a block (anchor-first), accepted while d_k = x_{a+k+1}, a step gaining accepted + 1;
  a pruned draft vocabulary picks among its kept rows and maps the pick to its target id.
  Compared EXACTLY: every step, token, histogram bin, acceptance and per-draft hit;
- the probabilistic tau, 1 + sum_k prod_{j<=k} (1 - L1_j / 2), teacher-forced (slot j's Markov
  head on x_{a+j}, q_j = softmax(lm_head . final[a+j])), L1 over the full vocabulary (p zero
  outside a pruned drafter's kept ids): <= 1e-6 relative;
- the confidence head along the chain, sigmoid(w . [norm(h_k); W1[d_{k-1}]] + b), at the walk's
  steps per slot reached, and its ECE over 10 bins: <= 1e-5 absolute (float32 head).

The same numbers come out of `dflash eval --json` (argv[1], the CLI), whose keys are a DFlash
drafter's on the same data plus the DSpark-only ones, so the two compare with one command.

Then the mutation check: the reference with one defect each (the chain fed the data's token
instead of its own argmax; DFlash's label shift, slot k compared with x_{a+k}; q read one
position late) must FAIL the comparison, so each is something this oracle catches.

Exit 77 (skip) when torch or numpy is missing.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

from oracle_env import HERE, np, torch  # noqa: E402  (numpy, torch or exit 77; the paths)
import torch_drafter as base  # noqa: E402
import libdflash  # noqa: E402
from libdflash.hidden import write_dataset  # noqa: E402
from libdflash.train import Trainer  # noqa: E402
from oracle_model_dspark import dspark_config, random_params  # noqa: E402

MUTATIONS = ["chain_fed_data", "dflash_label_shift", "q_one_late"]
PROB_TOL, CONF_TOL = 1e-6, 1e-5
ECE_BINS = 10


def bf16(a):
    """The value a bf16 store keeps (truncated to an exact bf16, so writing it is exact)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def runs(mask):
    """Maximal runs [s, e) of mask = 1."""
    out, s = [], 0
    while s < len(mask):
        if not mask[s]:
            s += 1
            continue
        e = s
        while e < len(mask) and mask[e]:
            e += 1
        out.append((s, e))
        s = e
    return out


class Ref:
    """The drafter in float64 from the spec: backbone (torch_drafter), heads, chain."""

    def __init__(self, cfg, P, embed, lm_head, kept):
        self.cfg, self.B, self.V = cfg, base.block_size(cfg), cfg["vocab_size"]
        self.P = {k: torch.tensor(v, dtype=torch.float64) for k, v in P.items()}
        self.embed = torch.tensor(embed, dtype=torch.float64)
        self.lm_head = torch.tensor(lm_head, dtype=torch.float64)
        self.kept = None if kept is None else [int(k) for k in kept]
        self.ids_of = list(range(self.V)) if kept is None else self.kept
        self.head = self.lm_head if kept is None else self.lm_head[torch.tensor(self.kept)]
        self.W1 = self.P["markov_head.markov_w1.weight"]
        self.W2 = self.P["markov_head.markov_w2.weight"]
        self.conf = cfg.get("enable_confidence_head")

    def rows(self, ids, hidden, anchors):
        return base.final_hidden(self.cfg, self.P, self.embed, torch.tensor(ids),
                                 torch.tensor(hidden, dtype=torch.float64), anchors)

    def logits(self, x, prev):
        return self.head @ x + self.W2 @ self.W1[int(prev)]

    def confidence(self, x, prev):
        w = self.P["confidence_head.proj.weight"][0]
        s = w @ torch.cat([x, self.W1[int(prev)]]) + self.P["confidence_head.proj.bias"][0]
        return float(torch.sigmoid(s))

    def chain(self, hf, n, a, ids, mutate=None):
        """Block n (anchor a): the greedy drafts and the confidence at each slot."""
        prev, drafts, confs = int(ids[a]), [], []
        for k in range(self.B):
            x = hf[n * self.B + k]
            confs.append(self.confidence(x, prev) if self.conf else None)
            d = self.ids_of[int(torch.argmax(self.logits(x, prev)))]
            drafts.append(d)
            prev = d
            if mutate == "chain_fed_data" and a + k + 1 < len(ids):
                prev = int(ids[a + k + 1])
        return drafts, confs

    def accept_prob(self, x, prev, final_row):
        """1 - L1/2 over the full vocabulary: p over the draft ids (0 elsewhere), q the
        target's softmax."""
        p = torch.zeros(self.V, dtype=torch.float64)
        p[torch.tensor(self.ids_of)] = self.logits(x, prev).softmax(-1)
        q = (self.lm_head @ final_row).softmax(-1)
        return 1.0 - 0.5 * float((p - q).abs().sum())


def ref_eval(R, samples, mutate=None):
    B = R.B
    shift = 0 if mutate == "dflash_label_shift" else 1
    out = {"steps": 0, "tokens": 0, "hist": np.zeros(B + 1, np.int64),
           "hits": np.zeros(B, np.int64), "scored": np.zeros(B, np.int64),
           "cpred": np.zeros(B), "cobs": np.zeros(B), "cn": np.zeros(B, np.int64),
           "bin_p": np.zeros(ECE_BINS), "bin_o": np.zeros(ECE_BINS), "bin_n": np.zeros(ECE_BINS),
           "walk": [], "pos": [], "prob": [], "accept": {}}
    for sid, ids, mask, hidden, final in samples:
        fin = torch.tensor(final, dtype=torch.float64)
        tok = stp = 0
        px = pn = pp = 0.0
        accept = np.full(len(ids), -1, np.int64)
        for s, e in runs(mask):
            anchors = list(range(s, e - 1))
            if not anchors:
                continue
            hf = R.rows(ids, hidden, anchors)
            confs = {}
            for n, a in enumerate(anchors):
                drafts, cf = R.chain(hf, n, a, ids, mutate)
                confs[a] = cf
                j = 0
                while j < B and a + j + 1 < e and drafts[j] == ids[a + j + shift]:
                    j += 1
                accept[a] = j
                for k in range(B):
                    if a + k + 1 < e:
                        out["hits"][k] += drafts[k] == ids[a + k + shift]
                        out["scored"][k] += 1
                tau, prod = 1.0, 1.0
                for k in range(B):
                    if a + k + 1 >= e:
                        break
                    qpos = a + k + (1 if mutate == "q_one_late" else 0)
                    prod *= R.accept_prob(hf[n * B + k], ids[a + k], fin[qpos])
                    tau += prod
                px, pn, pp = px + 1 + j, pn + 1, pp + tau
            p = s
            while p < e - 1:
                gain = min(accept[p] + 1, e - 1 - p)
                out["hist"][min(gain, B + 1) - 1] += 1
                for j in range(B):
                    if not (j <= accept[p] and p + j + 1 < e) or not R.conf:
                        break
                    c, ok = confs[p][j], float(j < accept[p])
                    b = min(max(int(c * ECE_BINS), 0), ECE_BINS - 1)
                    out["cpred"][j] += c
                    out["cobs"][j] += ok
                    out["cn"][j] += 1
                    out["bin_p"][b] += c
                    out["bin_o"][b] += ok
                    out["bin_n"][b] += 1
                tok, stp, p = tok + gain, stp + 1, p + gain
        out["accept"][sid] = accept
        out["steps"] += stp
        out["tokens"] += tok
        if stp:
            out["walk"].append((tok, stp))
        if pn:
            out["pos"].append((px, pn))
            out["prob"].append((pp, pn))
    return out


def ratio_se(pairs):
    x = np.array([p[0] for p in pairs], float)
    n = np.array([p[1] for p in pairs], float)
    r = x.sum() / n.sum()
    se = np.sqrt(((x - r * n) ** 2).sum() / (len(x) * (len(x) - 1))) / n.mean()
    return r, se


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


def compare(got, want, final):
    """Failures of libdflash's result against one reference (empty: it matches)."""
    f = []
    B = len(want["hits"])
    if (got["steps"], got["tokens"]) != (want["steps"], want["tokens"]):
        f.append(f"steps/tokens {got['steps']}/{got['tokens']} vs {want['steps']}/{want['tokens']}")
    if got["step_hist"].tolist() != want["hist"].tolist():
        f.append(f"step_hist {got['step_hist'].tolist()} vs {want['hist'].tolist()}")
    if got["scored"] != want["scored"].sum():
        f.append(f"scored {got['scored']} vs {want['scored'].sum()}")
    acc = want["hits"] / np.maximum(want["scored"], 1)
    if not np.array_equal(got["accuracy"], acc):
        f.append(f"accuracy {got['accuracy'].tolist()} vs {acc.tolist()}")
    wt, wse = ratio_se(want["walk"])
    pt, pse = ratio_se(want["pos"])
    if rel(got["walk_tau"], wt) > 1e-12 or rel(got["walk_tau_se"], wse) > 1e-9:
        f.append(f"walk tau {got['walk_tau']} +- {got['walk_tau_se']} vs {wt} +- {wse}")
    if rel(got["position_tau"], pt) > 1e-12 or rel(got["position_tau_se"], pse) > 1e-9:
        f.append(f"position tau {got['position_tau']} vs {pt}")
    if final:
        qt, qse = ratio_se(want["prob"])
        if got["prob_tau"] is None or rel(got["prob_tau"], qt) > PROB_TOL:
            f.append(f"probabilistic tau {got['prob_tau']} vs {qt}")
        elif rel(got["prob_tau_se"], qse) > 1e-4:
            f.append(f"probabilistic tau se {got['prob_tau_se']} vs {qse}")
    elif got["prob_tau"] is not None:
        f.append(f"probabilistic tau {got['prob_tau']} without a final state")
    if got["conf_count"] is not None:
        if got["conf_count"].tolist() != want["cn"].tolist():
            f.append(f"confidence counts {got['conf_count'].tolist()} vs {want['cn'].tolist()}")
        n = np.maximum(want["cn"], 1)
        if np.abs(got["conf_predicted"] - want["cpred"] / n).max() > CONF_TOL or \
                np.abs(got["conf_observed"] - want["cobs"] / n).max() > 1e-12:
            f.append(f"confidence {got['conf_predicted'].tolist()} / "
                     f"{got['conf_observed'].tolist()} vs {(want['cpred'] / n).tolist()} / "
                     f"{(want['cobs'] / n).tolist()}")
        ece = np.abs(want["bin_p"] - want["bin_o"]).sum() / want["bin_n"].sum()
        if abs(got["conf_ece"] - ece) > CONF_TOL:
            f.append(f"confidence ECE {got['conf_ece']} vs {ece}")
    return f, (wt, pt, ratio_se(want["prob"])[0] if final else None)


def make_world(root, cfg, rng, R, n_samples, with_final):
    """Held-out samples built so the drafter's chain is right for a planned number of slots at
    each anchor the walk visits (from the float64 reference), then a token it did not draft."""
    B, V, H = R.B, cfg["vocab_size"], cfg["hidden_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    samples = []
    for i in range(n_samples):
        S = int(rng.integers(26, 40))
        ids = rng.integers(0, V - 1, size=S).astype(np.int32)
        mask = np.zeros(S, np.uint8)
        cut = int(rng.integers(12, S - 8))
        mask[3:cut] = 1
        mask[cut + 2:] = 1
        hidden = bf16(rng.standard_normal((S, K * H)))
        final = bf16(rng.standard_normal((S, H)))
        for s, e in runs(mask):
            p = s
            while p < e - 1:
                hf = R.rows(ids, hidden, [p])
                drafts, _ = R.chain(hf, 0, p, ids)
                k = int(rng.integers(0, B + 1))
                for j in range(k):
                    if p + j + 1 < S:
                        ids[p + j + 1] = drafts[j]
                if k < B and p + k + 1 < S:
                    ids[p + k + 1] = (drafts[k] + 1 + int(rng.integers(V - 2))) % (V - 1)
                p += k + 1
        samples.append((f"s{i}", ids, mask, hidden, final if with_final else None))
    write_dataset(os.path.join(root, "data"), [(sid, ids, mask) for sid, ids, mask, _, _ in samples])
    with libdflash.HiddenWriter(os.path.join(root, "hidden"), num_layers=K, hidden_size=H,
                                final_state=with_final) as w:
        for sid, _, _, hidden, final in samples:
            if with_final:
                w.append(sid, hidden, final_state=final)
            else:
                w.append(sid, hidden)
    # the reference reads the same final state whether or not the store keeps it
    return [(sid, ids, mask, hidden, final if final is not None else np.zeros((len(ids), H),
                                                                           np.float32))
            for sid, ids, mask, hidden, final in samples]


def cli_eval(cli, root, ckpt):
    cmd = [cli, "eval", "--checkpoint", ckpt, "--target", os.path.join(root, "target"),
           "--data", os.path.join(root, "data"), "--hidden", os.path.join(root, "hidden"),
           "--threads", "2", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"dflash eval failed: {r.stderr}")
    return json.loads(r.stdout)


DSPARK_KEYS = {"probabilistic_tau", "probabilistic_tau_se", "confidence_predicted",
               "confidence_observed", "confidence_count", "confidence_ece"}


def run_case(name, cfg, seed, vd, with_final, cli, head_scale=0.7):
    """head_scale: of the frozen LM head (small: p and q near uniform, the Markov bias picks
    the drafts, and the probabilistic tau's later products count)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    embed = bf16(rng.standard_normal((V, H)))
    lm_head = bf16(head_scale * rng.standard_normal((V, H)))
    kept = None
    if vd:
        cfg = dict(cfg, draft_vocab_size=vd)
        kept = np.sort(rng.choice(V, size=vd, replace=False)).astype(np.int32)
    P = random_params(cfg, rng)
    if head_scale < 0.5:
        P["markov_head.markov_w2.weight"] *= np.float32(0.2)
    R = Ref(cfg, P, embed, lm_head, kept)
    failures = []
    with tempfile.TemporaryDirectory() as root:
        samples = make_world(root, cfg, rng, R, 5, with_final)
        os.mkdir(os.path.join(root, "target"))
        libdflash.write_safetensors(os.path.join(root, "target", "model.safetensors"),
                                    {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head})
        with Trainer(cfg, embed, lm_head, seed=1, n_threads=2) as tr:
            tr.set_parameters(P)
            if kept is not None:
                tr.set_draft_vocab(kept)
            got = tr.eval_walk(os.path.join(root, "data"), os.path.join(root, "hidden"))
            tr.save(os.path.join(root, "ckpt"))
        want = ref_eval(R, samples)
        failures, (wt, pt, qt) = compare(got, want, with_final)
        # `dflash eval --json`: the same numbers, DFlash's keys plus DSpark's
        js = cli_eval(cli, root, os.path.join(root, "ckpt"))
        for k, v in (("walk_tau", got["walk_tau"]), ("position_tau", got["position_tau"]),
                     ("steps", got["steps"]), ("tokens", got["tokens"])):
            if abs(js[k] - v) > 1e-6:
                failures.append(f"dflash eval --json {k} {js[k]} vs {v}")
        if js["probabilistic_tau"] != (None if qt is None else printed(got["prob_tau"])):
            failures.append(f"dflash eval --json probabilistic_tau {js['probabilistic_tau']} vs "
                            f"{got['prob_tau']}")
        if js["tokens_per_step_histogram"] != got["step_hist"].tolist():
            failures.append("dflash eval --json histogram")
        # a pruned drafter's coverage: the share of the data's supervised tokens it keeps
        with libdflash.Dataset(os.path.join(root, "data")) as ds:
            sup = [int(x) for _, ids, mask in ds for x, m in zip(ids, mask) if m]
        cov = None if kept is None else printed(np.isin(sup, kept).mean())
        if (js["draft_vocab_coverage"], js["draft_vocab_size"]) != (cov, vd or None):
            failures.append(f"dflash eval --json draft_vocab_coverage {js['draft_vocab_coverage']} "
                            f"(size {js['draft_vocab_size']}) vs {cov} of {len(sup)} (size {vd})")
        if (js["drafter"], js["drafts_per_block"], len(js["accuracy"])) != ("dspark", R.B, R.B):
            failures.append(f"dflash eval --json drafter {js['drafter']} {js['drafts_per_block']}")
        # a DFlash drafter on the same data: its keys are the DSpark drafter's less DSpark's
        dcfg = {k: v for k, v in cfg.items() if k not in (
            "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov", "sample_from_anchor", "draft_vocab_size")}
        dcfg["architectures"] = ["DFlashDraftModel"]
        with Trainer(dcfg, embed, lm_head, seed=1, n_threads=2) as td:
            td.save(os.path.join(root, "ckpt_dflash"))
        jd = cli_eval(cli, root, os.path.join(root, "ckpt_dflash"))
        if set(js) - set(jd) != DSPARK_KEYS or set(jd) - set(js):
            failures.append(f"keys: DSpark adds {sorted(set(js) - set(jd))}, lacks "
                            f"{sorted(set(jd) - set(js))}")
        if (jd["drafter"], jd["drafts_per_block"]) != ("dflash", R.B - 1):
            failures.append(f"DFlash drafter {jd['drafter']} {jd['drafts_per_block']}")
    caught = []
    for mut in MUTATIONS:
        if mut == "q_one_late" and not with_final:
            continue
        m_fail, _ = compare(got, ref_eval(R, samples, mut), with_final)
        (caught if m_fail else failures).append(mut if m_fail else f"mutation {mut} not caught")
    prob = f"{got['prob_tau']:.6f} (rel err {rel(got['prob_tau'], qt):.1e})" if qt else "null"
    ece = "null" if got["conf_ece"] is None else f"{got['conf_ece']:.4f}"
    print(f"{'ok' if not failures else 'FAIL'} {name}: walk tau {got['walk_tau']:.4f} "
          f"({got['steps']} steps, {got['tokens']} tokens, exact), position tau "
          f"{got['position_tau']:.4f}, probabilistic tau {prob}, ECE {ece}; "
          f"mutations caught: {', '.join(caught)}")
    for f in failures:
        print("   ", f)
    return not failures


def printed(x):
    """What `dflash eval --json` prints of x (%.6f)."""
    return float(f"{x:.6f}")


CASES = [
    # name, config, draft vocabulary (0: full), with the target's final state[, head scale]
    ("B=4, rank 6, confidence head",
     dspark_config(6, True, H=32, I=48, L=2, nh=4, nkv=2, d=8, V=61, B=4, K=2), 0, True),
    ("B=5, rank 6, confidence head, near-uniform heads (probabilistic tau well above 1)",
     dspark_config(6, True, H=32, I=48, L=1, nh=4, nkv=2, d=8, V=47, B=5, K=2), 0, True, 0.05),
    ("B=6, rank 4, confidence head, pruned V_d 24 of 61",
     dspark_config(4, True, H=24, I=32, L=1, nh=4, nkv=2, d=6, V=61, B=6, K=1), 24, True),
    ("B=4, no confidence head, store without the final state",
     dspark_config(5, False, H=16, I=24, L=1, nh=2, nkv=1, d=8, V=41, B=4, K=1), 0, False),
]


def main():
    if len(sys.argv) < 2:
        print("usage: oracle_eval_dspark.py DFLASH_CLI")
        return 2
    torch.set_num_threads(1)
    ok = sum(run_case(c[0], c[1], 500 + i, c[2], c[3], sys.argv[1], *c[4:])
             for i, c in enumerate(CASES))
    print(f"{ok} passed, {len(CASES) - ok} failed")
    return 0 if ok == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
