#!/usr/bin/env python3
"""DFlash 2 training step on the CPU: the LM-head work of two libdflash builds
on the same input (the selector loss's top-K candidates kept inside
the block CE's chunked LM-head pass instead of a second pass over the LM head).

The demo's drafter shape (examples/pipeline: SmolLM2-135M target, hidden 576,
intermediate 1536, 9/3 heads, vocabulary 49152, 1 layer, block 8, 3 target
layers) as a DFlash 2 drafter (conv_kernel_size 2, conv_group_size 16,
selector_top_k 16, selector_rank 256), one sequence of --seq tokens with
--anchors anchors (the demo trains 8 per sequence). Each library runs in its
own process (DFLASH_LIBRARY), the two alternating over --rounds rounds; the
script prints, per library, the best round's median forward + backward time
(dflash_trainer_forward_backward) and the minimum, and, for the
record, the LM head's GEMM FLOPs (rows R = anchors x (B-1), 2 R V H each):
the block CE computes the logits once and once more for its gradient; the
unfused selector loss computed the logits a third time. Then the ratio, and
whether the two libraries' losses and gradients are bit for bit equal (the
candidates and their ties must not change).

  python3 bench/dflash2_lmhead.py --lib BASE/libdflash.so --lib NEW/libdflash.so \
      [--threads 2] [--reps 3] [--rounds 3] [--seq 256] [--anchors 8]
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CFG = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 1,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "num_target_layers": 30, "block_size": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e5,
    "dflash_config": {"mask_token_id": 49151, "target_layer_ids": [1, 14, 27],
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 16,
                      "selector_rank": 256},
}


def bindings_for(lib):
    """The Python bindings of the library's own source tree (a build directory's
    parent), so each build is driven by the ctypes mirrors it was made with."""
    own = os.path.join(os.path.dirname(os.path.abspath(lib)), "..", "bindings", "python")
    return own if os.path.isdir(own) else os.path.join(HERE, "..", "bindings", "python")


def worker(args):
    sys.path.insert(0, bindings_for(os.environ["DFLASH_LIBRARY"]))
    import numpy as np
    from libdflash.train import Trainer
    rng = np.random.default_rng(7)
    V, H, K = CFG["vocab_size"], CFG["hidden_size"], 3
    embed = (0.02 * rng.standard_normal((V, H))).astype(np.float32)
    head = (0.05 * rng.standard_normal((V, H))).astype(np.float32)
    ids = rng.integers(0, V - 1, args.seq).astype(np.int32)
    mask = np.ones(args.seq, np.uint8)
    hidden = rng.standard_normal((args.seq, K * H)).astype(np.float32)
    anchors = np.sort(rng.choice(args.seq - CFG["block_size"], args.anchors, replace=False))
    with Trainer(CFG, embed, head, seed=3, n_threads=args.threads) as t:
        loss = t.forward_backward(ids, mask, hidden, anchors)  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            t.forward_backward(ids, mask, hidden, anchors)
            times.append(time.perf_counter() - t0)
        h = hashlib.sha256(np.float64(loss).tobytes())
        for name, g in sorted(t.gradients().items()):
            h.update(name.encode() + g.tobytes())
    times.sort()
    print(json.dumps({"median_s": times[len(times) // 2], "min_s": times[0], "loss": loss,
                      "digest": h.hexdigest()}))


def run(lib, args):
    env = dict(os.environ, DFLASH_LIBRARY=os.path.abspath(lib), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--worker", "--threads", str(args.threads), "--reps",
           str(args.reps), "--seq", str(args.seq), "--anchors", str(args.anchors)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleaved(libs, args):
    """--rounds rounds, the libraries alternating, so load from other jobs on
    a shared machine falls on both; per library the best median of a round and
    the overall minimum."""
    rounds = [[run(lib, args) for lib in libs] for _ in range(args.rounds)]
    out = []
    for i in range(len(libs)):
        rs = [r[i] for r in rounds]
        if len({r["digest"] for r in rs}) != 1:
            raise SystemExit(f"{libs[i]}: rounds disagree (not deterministic)")
        out.append(dict(rs[0], median_s=min(r["median_s"] for r in rs),
                        min_s=min(r["min_s"] for r in rs)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", default=[],
                    help="a libdflash.so (twice: the base, then the new build)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if len(args.lib) != 2:
        ap.error("give --lib twice: the base build, then the new one")
    R = args.anchors * (CFG["block_size"] - 1)
    gemm = 2 * R * CFG["vocab_size"] * CFG["hidden_size"] / 1e9
    print(f"DFlash 2 drafter, demo shape (H 576, V 49152, B 8, top-16, rank 256), seq "
          f"{args.seq}, {args.anchors} anchors: R = {R} supervised rows; one LM-head GEMM "
          f"(2 R V H) = {gemm:.2f} GFLOP; {args.threads} threads; {args.rounds} rounds of "
          f"{args.reps} steps, libraries alternating; best round median")
    res = interleaved(args.lib, args)
    for lib, r, gemms, what in zip(args.lib, res, (3, 2), (
            "CE logits + CE gradient + selector top-K logits",
            "CE logits (top-K kept in the same pass) + CE gradient")):
        print(f"  {lib}: forward+backward {r['median_s'] * 1e3:8.1f} ms (min "
              f"{r['min_s'] * 1e3:.1f}); LM head {gemms} GEMMs = {gemms * gemm:.2f} GFLOP "
              f"({what}), logits computed {gemms - 1} times; loss {r['loss']:.6f}")
    print(f"ratio base / new: {res[0]['median_s'] / res[1]['median_s']:.3f}x step time (minimum "
          f"{res[0]['min_s'] / res[1]['min_s']:.3f}x); LM-head GEMM FLOPs 3:2, logits passes 2:1")
    same = res[0]["digest"] == res[1]["digest"]
    print(f"loss and all gradients bit for bit equal: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
