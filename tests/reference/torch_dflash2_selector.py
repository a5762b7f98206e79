"""DFlash 2's selector loss (src/train/dflash2.c, df2_selector_loss) against
PyTorch autograd of the same objective written here: for each row
x_i (the drafter's final normed hidden), the top-K of its logits x_i E^T
(torch.topk, not differentiated; the unary scores are the candidates'
logits, differentiated), scores unary + <A[prev_i] * (P x_i), B[cand]> as
z-lab's CandidateSelector.select scores them (dflash 0.1.0, model.py:
predecessor codebook on the previous token, successor codebook on the
candidates), and the K-way CE of the true token; rows whose true token is
not a candidate are dropped ("drop") or get it in place of the lowest
candidate ("inject"). Loss = sum_i coef_i CE_i. The C side
(tests/train/dflash2_selector_tool.c) returns the loss, the candidate hits
and d/dx, dA, dB, dP; bound 1e-5 relative to each tensor's largest
reference entry (float32 both sides). 3 configs x both modes; each config
has rows whose true token is outside the top-K.

Needs the reference environment (.venv-ref, as tests/train/oracle_reference.py);
re-runs itself there and exits 77 (skip) when it is absent.
Usage: torch_dflash2_selector.py TOOL
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


sys.path.insert(0, HERE)
from refenv import reexec_in_ref_env  # noqa: E402

reexec_in_ref_env(__file__)

import numpy as np  # noqa: E402
import torch  # noqa: E402

REL_TOL = 1e-5
CASES = [  # R, H, V, r, K, chunk
    (12, 32, 97, 8, 4, 16), (20, 48, 300, 16, 16, 64), (9, 16, 50, 5, 3, 7),
]


def reference(x, E, A, B, P, target, prev, coef, K, inject):
    x, A, B, P = (torch.tensor(a, requires_grad=True) for a in (x, A, B, P))
    E = torch.tensor(E)
    logits = x @ E.T
    with torch.no_grad():
        _, cand = torch.topk(logits, K, dim=-1)
    total, hits = x.new_zeros(()), 0
    h = x @ P.T
    for i in range(x.shape[0]):
        c = cand[i].clone()
        where = (c == int(target[i])).nonzero()
        if len(where):
            hits += 1
            y = int(where[0])
        elif inject:
            y = K - 1
            c[y] = int(target[i])
        else:
            continue
        s = logits[i, c] + torch.einsum("r,kr->k", A[int(prev[i])] * h[i], B[c])
        total = total + float(coef[i]) * (torch.logsumexp(s, 0) - s[y])
    grads = torch.autograd.grad(total, (x, A, B, P), allow_unused=True)
    grads = [np.zeros(t.shape, np.float32) if g is None else g.numpy()
             for g, t in zip(grads, (x, A, B, P))]
    return [np.array([total.item()], np.float32)] + grads, hits


def rel(a, b):
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def run_case(tool, case, inject, rng, tmp):
    R, H, V, r, K, chunk = case
    x = rng.standard_normal((R, H)).astype(np.float32)
    E = (0.3 * rng.standard_normal((V, H))).astype(np.float32)
    A = rng.standard_normal((V, r)).astype(np.float32)
    B = rng.standard_normal((V, r)).astype(np.float32)
    P = (0.3 * rng.standard_normal((r, H))).astype(np.float32)
    logits = x @ E.T
    order = np.argsort(-logits, axis=1)
    # Half the rows' true token inside the top-K, half outside (when V allows).
    target = np.array([order[i, rng.integers(0, K)] if i % 2 == 0 else
                       order[i, rng.integers(K, V)] for i in range(R)], np.int32)
    prev = rng.integers(0, V, R).astype(np.int32)
    coef = rng.uniform(0.2, 1.5, R).astype(np.float32)
    src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    with open(src, "wb") as f:
        f.write(np.array([R, H, V, r, K, chunk, int(inject)], np.int32).tobytes())
        for a in (x, E, A, B, P, target, prev, coef):
            f.write(a.tobytes())
    subprocess.run([tool, src, dst], check=True)
    flat = np.fromfile(dst, np.float32)
    hits_c = int(flat[1])
    flat = np.concatenate([flat[:1], flat[2:]])
    theirs, hits = reference(x, E, A, B, P, target, prev, coef, K, inject)
    sizes = [t.size for t in theirs]
    ours = np.split(flat, np.cumsum(sizes)[:-1])
    errs = {name: rel(o, t.reshape(-1))
            for name, o, t in zip(("loss", "dx", "dA", "dB", "dP"), ours, theirs)}
    ok = all(e <= REL_TOL for e in errs.values()) and hits == hits_c
    print(f"{'ok' if ok else 'FAIL'} {'inject' if inject else 'drop'} R {R}, H {H}, V {V}, "
          f"r {r}, K {K}, chunk {chunk}: hits {hits_c}/{R} (torch {hits}), " +
          ", ".join(f"{name} {e:.1e}" for name, e in errs.items()))
    return ok


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    torch.set_num_threads(1)
    rng = np.random.default_rng(2026)
    n = 0
    with tempfile.TemporaryDirectory(prefix="dflash2-selector-") as tmp:
        for c in CASES:
            for inject in (False, True):
                n += run_case(sys.argv[1], c, inject, rng, tmp)
    print(f"{n} passed, {2 * len(CASES) - n} failed")
    return 0 if n == 2 * len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
