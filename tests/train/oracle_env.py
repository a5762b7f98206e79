"""What the float64 oracles of this folder start with (oracle_model, oracle_model_dspark,
oracle_optim, oracle_eval_dspark): numpy and torch, or exit 77 (meson's skip) naming the one
missing; and this folder and tests/reference (the PyTorch models written from the specs) on
sys.path, so that `import torch_drafter` and the sibling oracles resolve. Import it first:
`from oracle_env import np, torch`."""
import os
import sys

try:
    import numpy as np
    import torch
except ImportError as exc:  # pragma: no cover
    print(f"skip: {exc}")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(HERE, "..", "reference"), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["np", "torch", "HERE"]
