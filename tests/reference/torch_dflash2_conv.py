"""DFlash 2's grouped dynamic causal convolution (src/train/dflash2.c) against
PyTorch autograd of z-lab's own `_grouped_dynamic_convolve` (PyPI dflash
0.1.0, dflash/model.py), forward and backward.

libdflash convolves T = n_blocks * B rows with the taps stopping at each
block's first position; z-lab drafts one block at a time, so its function
gets the blocks as the batch dimension (zero padding before each block).
For out = residual + conv(x; dyn, base) and a random upstream gradient dout,
the C side (tests/train/dflash2_conv_tool.c) returns out, dx, ddyn and
dbase; torch.autograd.grad gives the reference ones. Bound: 1e-5 relative
to each tensor's largest reference entry (float32 both sides); a wrong
boundary or group index is O(1). Configs: k 1..4, g 4..16, B 3..16,
several blocks.

Needs the reference environment (.venv-ref, as tests/train/oracle_reference.py);
re-runs itself there and exits 77 (skip) when it is absent.
Usage: torch_dflash2_conv.py TOOL
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
from dflash.model import _grouped_dynamic_convolve  # noqa: E402

REL_TOL = 1e-5
CASES = [  # n_blocks, B, H, k, g
    (3, 8, 64, 2, 16), (4, 6, 48, 3, 8), (2, 16, 32, 4, 4), (5, 3, 16, 1, 16), (2, 4, 32, 3, 16),
]


def reference(x, dyn, base, res, dout, g):
    """z-lab's convolution per block (batch = blocks) + residual, and autograd."""
    x, dyn, base = (torch.tensor(a, requires_grad=True) for a in (x, dyn, base))
    out = torch.tensor(res) + _grouped_dynamic_convolve(x, dyn, base, g)
    dx, ddyn, dbase = torch.autograd.grad(out, (x, dyn, base), torch.tensor(dout))
    return [t.detach().numpy() for t in (out, dx, ddyn, dbase)]


def rel(a, b):
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def run_case(tool, case, rng, tmp):
    n, B, H, k, g = case
    G = H // g
    x = rng.standard_normal((n, B, H)).astype(np.float32)
    dyn = (0.5 * rng.standard_normal((n, B, k, G))).astype(np.float32)
    base = rng.standard_normal((k, H)).astype(np.float32)
    res = rng.standard_normal((n, B, H)).astype(np.float32)
    dout = rng.standard_normal((n, B, H)).astype(np.float32)
    src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    with open(src, "wb") as f:
        f.write(np.array([n * B, B, H, k, g], np.int32).tobytes())
        for a in (x, dyn, base, res, dout):
            f.write(a.tobytes())
    subprocess.run([tool, src, dst], check=True)
    flat = np.fromfile(dst, np.float32)
    sizes = [x.size, x.size, dyn.size, base.size]
    ours = np.split(flat, np.cumsum(sizes)[:-1])
    theirs = reference(x, dyn, base, res, dout, g)
    errs = {name: rel(o, t.reshape(-1))
            for name, o, t in zip(("out", "dx", "ddyn", "dbase"), ours, theirs)}
    ok = all(e <= REL_TOL for e in errs.values())
    print(f"{'ok' if ok else 'FAIL'} blocks {n} x B {B}, H {H}, k {k}, g {g}: " +
          ", ".join(f"{name} {e:.1e}" for name, e in errs.items()))
    return ok


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    torch.set_num_threads(1)
    rng = np.random.default_rng(2026)
    with tempfile.TemporaryDirectory(prefix="dflash2-conv-") as tmp:
        ok = sum(run_case(sys.argv[1], c, rng, tmp) for c in CASES)
    print(f"{ok} passed, {len(CASES) - ok} failed")
    return 0 if ok == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
