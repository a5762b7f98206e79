#!/usr/bin/env python3
"""CPU training step of the DFlash drafter: libdflash (float32 reference
backend, OpenBLAS + thread pool) vs the same model and loss in PyTorch
(float32 autograd, same weights and inputs, same thread count).

Prints step times, the ratio, tokens/s, and the achieved GFLOP/s against
the machine's OpenBLAS SGEMM rate (the CPU ceiling).

  DFLASH_LIBRARY=build/libdflash.so PYTHONPATH=bindings/python:tests/train \
      python3 bench/train_cpu.py [--threads N] [--reps N]
"""
import argparse
import ctypes
import ctypes.util
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))

import torch  # noqa: E402
import torch_drafter as ref  # noqa: E402
from libdflash.train import Trainer  # noqa: E402

CFG = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8192,
    "num_target_layers": 24, "block_size": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "dflash_config": {"mask_token_id": 8191, "target_layer_ids": [1, 11, 21]},
}
S, N_ANCHORS = 512, 32


def sgemm_gflops(threads, n=1024, reps=9):
    """OpenBLAS cblas_sgemm rate on this machine (n x n x n)."""
    path = ctypes.util.find_library("openblas") or "libopenblas.so.0"
    lib = ctypes.CDLL(path)
    if hasattr(lib, "openblas_set_num_threads"):
        lib.openblas_set_num_threads(threads)
    a = np.random.rand(n, n).astype(np.float32)
    b = np.random.rand(n, n).astype(np.float32)
    c = np.zeros((n, n), np.float32)
    P = ctypes.c_void_p
    lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P,
                                                      ctypes.c_int, ctypes.c_float, P, ctypes.c_int]
    args = (101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, b.ctypes.data, n, 0.0, c.ctypes.data, n)
    lib.cblas_sgemm(*args)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        lib.cblas_sgemm(*args)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def forward_flops(anchors):
    """Matmul FLOPs of one forward pass (attention over visible keys only)."""
    H, I, L = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_hidden_layers"]
    nh, nkv, d, V = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"], CFG["vocab_size"]
    B, K = CFG["block_size"], len(CFG["dflash_config"]["target_layer_ids"])
    T, Sc = len(anchors) * B, int(max(anchors))
    f = 2 * Sc * K * H * H  # fc
    per_layer = 2 * T * H * (nh * d + 2 * nkv * d) + 2 * Sc * H * 2 * nkv * d
    per_layer += 2 * T * nh * d * H + 3 * 2 * T * H * I
    keys = sum(int(a) + B for a in anchors) * B
    per_layer += 2 * 2 * keys * nh * d
    R = len(anchors) * (B - 1)
    return f + L * per_layer + 2 * R * H * V


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    V, H = CFG["vocab_size"], CFG["hidden_size"]
    K = len(CFG["dflash_config"]["target_layer_ids"])
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (0.05 * rng.standard_normal((V, H))).astype(np.float32)
    ids = rng.integers(0, V - 1, S).astype(np.int32)
    mask = np.ones(S, np.uint8)
    hidden = rng.standard_normal((S, K * H)).astype(np.float32)
    anchors = np.sort(rng.choice(np.arange(1, S - 16), N_ANCHORS, replace=False)).astype(np.int32)
    gamma = 7.0

    tr = Trainer(CFG, embed, lm_head, seed=1, n_threads=args.threads, loss_gamma=gamma)
    params = tr.parameters()
    tr.forward_backward(ids, mask, hidden, anchors)  # warm-up (allocations)

    # PyTorch: the oracle's model in float32; the dense mask is built once
    # outside the timed region so Python loops do not count against it.
    masks = {}
    orig = ref.dflash_mask
    ref.dflash_mask = lambda a, s, b, w=None: masks.setdefault((s, b, w), orig(a, s, b, w))
    P = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    E, W = torch.tensor(embed), torch.tensor(lm_head)
    ti, tm, th = torch.tensor(ids), torch.tensor(mask), torch.tensor(hidden)

    def torch_step():
        for p in P.values():
            p.grad = None
        loss = ref.loss_fn(CFG, P, E, W, ti, tm, th, anchors, gamma)
        loss.backward()
        return loss.item()

    torch_step()
    # Alternate the two so that load from other processes hits both alike;
    # report the best of the repetitions (least disturbed) and the median.
    times_c, times_t = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        loss_c = tr.forward_backward(ids, mask, hidden, anchors)
        times_c.append(time.perf_counter() - t)
        t = time.perf_counter()
        loss_t = torch_step()
        times_t.append(time.perf_counter() - t)
    t_c, t_t = min(times_c), min(times_t)
    med_c, med_t = float(np.median(times_c)), float(np.median(times_t))

    flops = 3 * forward_flops(anchors)
    peak = sgemm_gflops(args.threads)
    tokens = N_ANCHORS * CFG["block_size"]
    print(f"config: H={H} I={CFG['intermediate_size']} L={CFG['num_hidden_layers']} "
          f"heads={CFG['num_attention_heads']}/{CFG['num_key_value_heads']} V={V} "
          f"B={CFG['block_size']} S={S} anchors={N_ANCHORS}, threads={args.threads}")
    print(f"loss: libdflash {loss_c:.6f}  torch {loss_t:.6f}")
    print(f"step (forward+backward), best of {args.reps}: libdflash {t_c * 1e3:.1f} ms, torch "
          f"{t_t * 1e3:.1f} ms, ratio torch/libdflash = {t_t / t_c:.2f}x (medians {med_c * 1e3:.1f} "
          f"/ {med_t * 1e3:.1f} ms, {med_t / med_c:.2f}x)")
    print(f"libdflash: {tokens / t_c:.0f} draft tokens/s, {flops / t_c / 1e9:.1f} GFLOP/s "
          f"= {100 * flops / t_c / 1e9 / peak:.0f}% of OpenBLAS SGEMM ({peak:.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
