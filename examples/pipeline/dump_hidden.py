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

--final-state also stores the target's final hidden state AFTER its final norm,
[S, H] per sample (HiddenWriter(..., final_state=True)), which a DSpark drafter
trains its L1 term and confidence head on (without it: 0.1 CE alone). Hugging
Face's hidden_states[-1] of the whole model is that state: transformers replaces
the last decoder layer's raw output by norm(output) there (checked on 4.46.3:
hidden_states[-1] == last_hidden_state == norm(layer L-1 output), and
logits == lm_head(hidden_states[-1]); the raw output is in no entry). The whole
model runs for it, and each token costs H more bf16 values: (K+1)/K of the bytes.
With --spool-budget the spool carries it too (`dflash train --hidden spool:DIR`
then trains DSpark's L1 and confidence terms from the spool as from a store).
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


def hidden_rows(body, ids, layers, final_state=False):
    """[S, K*H] bfloat16: the chosen layers' outputs for one token sequence; with the
    whole causal LM as `body`, also its greedy tokens [S] (else None); with final_state
    (the whole model), its post-norm final state [S, H] bfloat16 as a third value (else
    None)."""
    with torch.no_grad():
        out = body(torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True,
                   use_cache=False)
    rows = torch.cat([out.hidden_states[k + 1][0] for k in layers], dim=-1).to(torch.bfloat16)
    logits = getattr(out, "logits", None)
    tids = None if logits is None else logits[0].argmax(-1).to(torch.int32)
    # The last entry is norm(last layer's output), what the LM head reads (module docstring).
    fin = out.hidden_states[-1][0].to(torch.bfloat16) if final_state else None
    return rows, tids, fin


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
    ap.add_argument("--final-state", action="store_true",
                    help="also store the target's post-norm final state, for DSpark's L1 and "
                         "confidence terms (the whole model runs; a spool carries it too)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    layers = [int(x) for x in a.layers.split(",")]
    t = Target()
    # Every layer id is below the last, whose output Hugging Face normalises: the whole
    # model gives the same hidden_states[k + 1], and logits.
    # --final-state reads hidden_states[-1], which only the whole model normalises correctly.
    whole = a.target_ids or a.final_state
    body = t.model() if whole else truncated(t.model(), max(layers))
    if a.spool_budget:
        return spool(a, t, body, layers)
    t0, tokens = time.time(), 0
    with libdflash.Dataset(a.data) as ds, \
            libdflash.HiddenWriter(a.out, num_layers=len(layers), hidden_size=t.hidden,
                                dtype="bf16", shard_bytes=a.shard_bytes or None,
                                final_state=a.final_state) as w:
        n = len(ds)
        for i, (sid, ids, _mask) in enumerate(ds):
            rows, tids, fin = hidden_rows(body, np.array(ids), layers, a.final_state)
            w.append(sid, rows, target_ids=tids if a.target_ids else None, final_state=fin)
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
                                   spool_budget=a.spool_budget, final_state=a.final_state) as w:
        for epoch in range(w.spool_status()["epoch"], a.epochs):
            for sid, ids, _mask in ds:  # the same order on every restart
                if sid in w:
                    continue  # published before a crash
                t1 = time.time()
                rows, tids, fin = hidden_rows(body, np.array(ids), layers, a.final_state)
                t2 = time.time()
                # blocks while the spool is full
                w.append(sid, rows, target_ids=tids if a.target_ids else None, final_state=fin)
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
