"""Dump the target's hidden states for every sample of a tokenized dataset
into a libdflash hidden-state store (libdflash.HiddenWriter).

    python dump_hidden.py --data out/data/train --out out/hidden/train --layers 1,14,27

Spool mode (--spool-budget BYTES): --out is a spool that `dflash train --hidden
spool:DIR` consumes while it is written; the producer re-prefills every sample
once per epoch (--epochs), ending each with end_epoch(), and blocks while the
unconsumed shards fill the budget. --status FILE gets the spool's high-water
mark and how long the appends were blocked.

Layer id k is hidden_states[k + 1] of the whole model (the output of decoder
layer k; Hugging Face normalises only the last layer's). Only the decoder
layers up to the deepest requested one are run (no LM head), unless
--target-ids: then the whole model runs and each sample also stores
logits.argmax(-1), the target's greedy token after every position (the labels
of `dflash train --labels target`, 4 bytes per token).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import libdflash  # noqa: E402
from target import Target  # noqa: E402


def truncated(model, deepest):
    """The model's decoder stack cut after layer `deepest`, giving the same
    hidden_states[k+1] as the whole model. Hugging Face applies the final
    norm to the LAST entry of hidden_states: in the whole model that is
    layer L-1's output, in a cut stack it would be layer `deepest`'s, so the
    cut stack's norm becomes the identity. (Measured before this: layer 27 of
    SmolLM2 dumped with RMS 1.6 instead of 109, while live decoding fed the
    drafter the raw output, and live tau fell from 1.161 to 1.086.)"""
    body = model.model
    if deepest < len(body.layers) - 1:
        body.layers = body.layers[:deepest + 1]
        body.norm = torch.nn.Identity()
    return body


def hidden_rows(body, ids, layers):
    """[S, K*H] bfloat16: the chosen layers' outputs for one token sequence; with the
    whole causal LM as `body`, also its greedy tokens [S] (else None)."""
    with torch.no_grad():
        out = body(torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True,
                   use_cache=False)
    rows = torch.cat([out.hidden_states[k + 1][0] for k in layers], dim=-1).to(torch.bfloat16)
    logits = getattr(out, "logits", None)
    return rows, None if logits is None else logits[0].argmax(-1).to(torch.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", required=True, help="target layer ids, comma-separated")
    # One thread: on a busy 2-core machine PyTorch's second thread costs more
    # than it brings (measured 4x slower with two under load).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spool-budget", type=int, default=0, help="bytes: write a spool")
    ap.add_argument("--shard-bytes", type=int, default=0, help="shard size (the library's default)")
    ap.add_argument("--epochs", type=int, default=1, help="spool: epochs to prefill")
    ap.add_argument("--status", default=None, help="spool: write the producer's numbers here")
    ap.add_argument("--target-ids", action="store_true",
                    help="also store the target's greedy tokens (the whole model runs)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    layers = [int(x) for x in a.layers.split(",")]
    t = Target()
    # Every layer id is below the last, whose output Hugging Face normalises: the whole
    # model gives the same hidden_states[k + 1], and logits.
    body = t.model() if a.target_ids else truncated(t.model(), max(layers))
    if a.spool_budget:
        return spool(a, t, body, layers)
    t0, tokens = time.time(), 0
    with libdflash.Dataset(a.data) as ds, \
            libdflash.HiddenWriter(a.out, num_layers=len(layers), hidden_size=t.hidden,
                                dtype="bf16", shard_bytes=a.shard_bytes or None) as w:
        n = len(ds)
        for i, (sid, ids, _mask) in enumerate(ds):
            rows, tids = hidden_rows(body, np.array(ids), layers)
            w.append(sid, rows, target_ids=tids)
            tokens += len(ids)
            done = (i + 1) / n
            bar = "#" * int(30 * done)
            print(f"\rhidden states [{bar:<30}] {i + 1}/{n} samples, {tokens} tokens, "
                  f"{tokens / (time.time() - t0):.0f} tok/s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def spool(a, t, body, layers):
    """Re-prefill the dataset once per epoch into the spool. The time inside
    append beyond its own work is the producer waiting for the trainer to free
    room; spool_status() after every append gives the high-water mark."""
    t0, forward_s, append_s, st = time.time(), 0.0, 0.0, {}
    with libdflash.Dataset(a.data) as ds, \
            libdflash.HiddenWriter(a.out, num_layers=len(layers), hidden_size=t.hidden,
                                   dtype="bf16", shard_bytes=a.shard_bytes or None,
                                   spool_budget=a.spool_budget) as w:
        for epoch in range(w.spool_status()["epoch"], a.epochs):
            for sid, ids, _mask in ds:  # the same order on every restart
                if sid in w:
                    continue  # published before a crash
                t1 = time.time()
                rows, tids = hidden_rows(body, np.array(ids), layers)
                t2 = time.time()
                w.append(sid, rows, target_ids=tids)  # blocks while the spool is full
                forward_s, append_s = forward_s + t2 - t1, append_s + time.time() - t2
            w.end_epoch()
            st = w.spool_status()
            print(f"spool epoch {epoch} published: {st}", file=sys.stderr, flush=True)
    res = {"budget": a.spool_budget, "shard_bytes": a.shard_bytes, "epochs": a.epochs,
           "high_water": st.get("high_water", 0), "forward_s": round(forward_s, 2),
           "append_s": round(append_s, 2), "wall_s": round(time.time() - t0, 2)}
    if a.status:
        with open(a.status, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res), file=sys.stderr)

if __name__ == "__main__":
    main()
