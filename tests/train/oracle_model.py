"""Oracle: libdflash's float32 CPU drafter vs an independent PyTorch float64
implementation (tests/reference/torch_drafter.py) on random tiny configs. Compares the loss
and EVERY parameter gradient.

Error measure per tensor: max|g_c - g_ref| / max|g_ref| (relative to the
tensor's largest entry, so near-zero entries do not blow it up). Bound 1e-4
for gradients, 1e-5 for the loss. Why: the reference runs in float64, so the
difference is the C float32 rounding alone; float32 has eps 6e-8 and the
longest sums here have ~10^2-10^3 terms, giving expected errors ~1e-6; 1e-4
leaves two orders of margin while any real defect (one wrong mask entry, a
missed term, a wrong RoPE position) shows up as 1e-2..1.

Exit 77 (skip) when torch or numpy is missing.
"""
import sys

from oracle_env import np, torch  # noqa: E402  (numpy, torch or exit 77; the paths)
import torch_drafter as ref  # noqa: E402
import libdflash  # noqa: E402
from libdflash.train import Trainer  # noqa: E402

GRAD_TOL = 1e-4
LOSS_TOL = 1e-5


def make_config(H, I, L, nh, nkv, d, V, B, K, n_target=12, rope=None, layer_types=None,
                window=None, theta=10000.0, partial_rotary_factor=None):
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": d,
        "rms_norm_eps": 1e-6, "rope_theta": theta, "rope_scaling": rope,
        "max_position_embeddings": 4096, "vocab_size": V, "num_target_layers": n_target,
        "block_size": B,
        "dflash_config": {"mask_token_id": V - 1, "block_size": B,
                          "target_layer_ids": list(range(1, 1 + K))},
    }
    if partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = partial_rotary_factor
    if rope:  # engines disagree unless factor == max_position / original
        cfg["max_position_embeddings"] = int(rope["factor"] * rope["original_max_position_embeddings"])
    if layer_types:
        cfg["layer_types"] = layer_types
        cfg["use_sliding_window"] = "sliding_attention" in layer_types
        cfg["sliding_window"] = window
    return cfg


def random_params(cfg, rng):
    P = {}
    for name, shape in ref.param_shapes(cfg).items():
        if len(shape) == 1:
            P[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            P[name] = (rng.standard_normal(shape) / np.sqrt(shape[1]) * 1.5).astype(np.float32)
    return P


def rel_err(a, b):
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def run_case(name, cfg, S, anchors, mask_holes, gamma, vocab_chunk, seed):
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (0.5 * rng.standard_normal((V, H))).astype(np.float32)
    ids = rng.integers(0, V - 1, size=S).astype(np.int32)
    loss_mask = np.ones(S, dtype=np.uint8)
    for lo, hi in mask_holes:
        loss_mask[lo:hi] = 0
    hidden = rng.standard_normal((S, K * H)).astype(np.float32)
    P = random_params(cfg, rng)

    with Trainer(cfg, embed, lm_head, seed=1, loss_gamma=gamma, vocab_chunk=vocab_chunk,
                 n_threads=2) as tr:
        tr.set_parameters(P)
        loss_c = tr.forward_backward(ids, loss_mask, hidden, anchors)
        grads_c = tr.gradients()

    Pt = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in P.items()}
    g_eff = gamma if gamma != 0 else libdflash.train.default_loss_gamma(ref.block_size(cfg))
    loss_t = ref.loss_fn(cfg, Pt, torch.tensor(embed, dtype=torch.float64),
                         torch.tensor(lm_head, dtype=torch.float64), torch.tensor(ids),
                         torch.tensor(loss_mask), torch.tensor(hidden, dtype=torch.float64),
                         anchors, g_eff)
    loss_t.backward()

    failures = []
    lerr = abs(loss_c - loss_t.item()) / abs(loss_t.item())
    if lerr > LOSS_TOL:
        failures.append(f"loss {loss_c} vs {loss_t.item()} (rel {lerr:.2e})")
    worst, worst_name = 0.0, ""
    for pname, pt in Pt.items():
        e = rel_err(grads_c[pname], pt.grad.numpy())
        if e > worst:
            worst, worst_name = e, pname
        if not (e <= GRAD_TOL):
            failures.append(f"grad {pname}: rel {e:.2e}")
    status = "ok" if not failures else "FAIL"
    print(f"{status} {name}: loss {loss_c:.6f} (rel err {lerr:.1e}), {len(Pt)} gradients, "
          f"worst rel err {worst:.2e} ({worst_name})")
    for f in failures:
        print("   ", f)
    return not failures


CASES = [
    # name, config, S, anchors, loss-mask holes, gamma, vocab chunk
    ("plain rope, MHA (ratio 1), B=4, anchors at both ends",
     make_config(H=32, I=48, L=2, nh=4, nkv=4, d=8, V=97, B=4, K=2),
     40, [0, 1, 7, 20, 37, 39], [(10, 14), (30, 31)], 3.0, 16),
    ("YaRN, GQA ratio 2, B=8, nh*d != H, default gamma",
     make_config(H=48, I=64, L=2, nh=4, nkv=2, d=16, V=131, B=8, K=3, theta=50000.0,
                 rope={"rope_type": "yarn", "factor": 64.0,
                       "original_max_position_embeddings": 32, "beta_fast": 32.0,
                       "beta_slow": 1.0}),
     56, [2, 5, 17, 30, 47, 52], [(20, 26)], 0.0, 50),
    ("YaRN with explicit attention factor, GQA ratio 4, B=16, 3 layers",
     make_config(H=32, I=40, L=3, nh=4, nkv=1, d=8, V=61, B=16, K=2, theta=1e6,
                 rope={"type": "yarn", "factor": 4.0, "attention_factor": 1.3,
                       "original_max_position_embeddings": 16}),
     72, [3, 16, 40, 60], [(0, 2), (45, 50), (70, 72)], 7.0, 7),
    ("sliding + full layers (window 5), GQA ratio 2, B=6, many packed blocks",
     make_config(H=24, I=32, L=3, nh=4, nkv=2, d=6, V=53, B=6, K=1,
                 layer_types=["full_attention", "sliding_attention", "full_attention"], window=5),
     48, [1, 4, 9, 12, 18, 25, 33, 41, 44, 47], [(15, 17), (35, 40)], -1.0, 64),
    ("partial_rotary_factor 0.5 (RoPE on 8 of 16 dims), GQA ratio 2, B=8",
     make_config(H=32, I=48, L=2, nh=4, nkv=2, d=16, V=67, B=8, K=2, partial_rotary_factor=0.5),
     40, [0, 5, 13, 31, 39], [(20, 23)], 0.0, 32),
    ("partial_rotary_factor 0.25 with YaRN and a sliding layer, B=4",
     make_config(H=32, I=40, L=2, nh=2, nkv=1, d=16, V=53, B=4, K=1, theta=50000.0,
                 partial_rotary_factor=0.25,
                 rope={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8},
                 layer_types=["sliding_attention", "full_attention"], window=3),
     36, [0, 2, 9, 20, 33, 35], [(10, 12)], 3.0, 53),
    ("odd block size B=5, single target layer, empty mask tail",
     make_config(H=16, I=24, L=1, nh=2, nkv=1, d=8, V=41, B=5, K=1),
     30, [0, 6, 11, 25, 28], [(26, 30)], 2.5, 41),
]


def main():
    torch.set_num_threads(1)
    ok = 0
    for i, case in enumerate(CASES):
        ok += run_case(*case, seed=100 + i)
    print(f"{ok} passed, {len(CASES) - ok} failed")
    return 0 if ok == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
