#!/usr/bin/env python3
"""What a single-pass attention backward would cost, priced with bench/gpu_model.py's terms.

cuda/attention.cu runs the backward as two passes (attention_backward_q: dQ over every key and the
block's own dK / dV; attention_backward_ctx: the context dK / dV, recomputing QK^T and dO V^T). The
deterministic single pass compared here is KV-major: one CTA per (context key tile, kv head)
over the blocks that see it computes S, dP, dK += dS^T Q, dV += P^T dO and dQ's partial
dS K, written as fp32 per (block, tile) pair and summed in tile order by a second kernel
(what remains of attention_backward_q, the block tiles and D, is kept at its share of the time).
Printed per drafter: the two passes' time, the single pass's, and the dQ partials' scratch
per layer, which that design needs and the two passes do not.

  bench/attn_single_pass.py [qwen3-8b] [kimi] [--gpu H200]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_model as gm  # noqa: E402


def compare(name, gpu_name):
    c, g = gm.load_config(name), gm.GPUS[gpu_name]
    s = gm.Seq(c, 3072, 512)
    d, nkv = c["head_dim"], c["num_key_value_heads"]
    two = one = scratch = 0.0
    for l in range(c["num_hidden_layers"]):
        ops = gm.attention_ops(c, s, l, g, "wmma")
        q = next(o for o in ops if o.kernel == "attention_backward_q")
        x = next(o for o in ops if o.kernel == "attention_backward_ctx")
        Mp, N = -(-x.extra["M"] // 16) * 16, x.extra["N"]
        cols = x.flops / (nkv * 8.0 * Mp * d)   # tile widths summed over (tile, block) pairs
        pairs = cols / N
        part = nkv * pairs * Mp * d * 4         # fp32 dQ partials of one layer
        o = gm.Op("single pass", "attn_bwd_kv", "attn", x.flops + nkv * 2.0 * Mp * cols * d,
                  x.bytes + 2 * part, x.model_flops, extra=dict(x.extra))
        o.extra["smem_traffic"] = (x.extra["smem_traffic"] + part +
                                   nkv * 2.0 * Mp * d * cols * gm.frag_bytes(Mp, d, N, (2, 2), 0))
        blk = s.A * 10.0 * Mp * 16 / (q.flops / nkv / d)  # attention_backward_q's block-tile share
        two += gm.op_time(q, g, 1) + gm.op_time(x, g, 1)
        one += gm.op_time(o, g, 1) + blk * gm.op_time(q, g, 1)
        scratch = max(scratch, part)
    print(f"{name} on {gpu_name}: two passes {two * 1e3:.1f} ms, single pass with fp32 dQ "
          f"partials {one * 1e3:.1f} ms (ratio {one / two:.2f}), scratch {scratch / 1e9:.2f} GB "
          f"per layer")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["qwen3-8b", "kimi"])
    ap.add_argument("--gpu", default="H200", choices=sorted(gm.GPUS))
    a = ap.parse_args()
    for name in a.configs:
        compare(name, a.gpu)


if __name__ == "__main__":
    main()
