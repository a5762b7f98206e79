"""Live speculative decoding: the target (PyTorch) decodes greedily and
verifies the blocks a trained drafter (libdflash, libdflash.Trainer.predict)
proposes; tau = tokens gained per verification step. Beside it, on the same
held-out samples, the numbers that are meant to predict it:

    python live_check.py --checkpoint out/drafter --target-dir out/target \
        --data out/data/heldout --hidden out/hidden/heldout --max-new 128 -o out/live.json

  walk     libdflash.train.walk on the stored (bf16) hidden states and the
           dataset's tokens: what `dflash eval` reports as the walk tau
  forced   the same walk with float32 hidden states from a fresh PyTorch
           forward (checks the dump and the context alignment)
  live     real greedy speculative decoding from the sample's prompt

Each live step: the drafter gets the last verified token as its anchor and
the target's hidden states of every earlier token; the target runs the block
[anchor, d1..d(B-1)] in one forward pass (KV cache of the verified prefix);
drafted tokens are accepted while they equal the target's argmax, plus one
token from the target itself. Greedy verification is lossless: the output
equals plain greedy decoding (checked on the first prompt). Gains past
--max-new are not counted, as the walk cuts each answer at --max-new.

The dataset's answers come from llama.cpp (Q4_1 kernels), the live target
is the float32 PyTorch model: the report counts how often the PyTorch argmax
equals the dataset's next token (teacher forced) and after how many tokens
the two greedy continuations part.

Standard errors: bootstrap over samples (stats.py); live vs walk agree when
their paired difference is within 2 of its standard errors.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import libdflash  # noqa: E402
import stats  # noqa: E402
from target import Target  # noqa: E402


class Verifier:
    """The target with a KV cache over the verified prefix; keeps the chosen
    layers' hidden states of every verified token."""

    def __init__(self, model, layers):
        self.model, self.layers = model, layers
        self.cache = None

    def forward(self, ids, start):
        from transformers import DynamicCache
        if self.cache is None:
            self.cache = DynamicCache()
        self.cache.crop(start)  # drop rejected positions
        with torch.no_grad():
            out = self.model(torch.tensor([ids]), past_key_values=self.cache, use_cache=True,
                             output_hidden_states=True,
                             position_ids=torch.arange(start, start + len(ids))[None])
        h = torch.cat([out.hidden_states[k + 1][0] for k in self.layers], -1).float().numpy()
        return out.logits[0].argmax(-1).tolist(), h


def speculate(ver, drafter, prompt, max_new, stop):
    """Greedy speculative decoding; returns (tokens, gain per step). The
    first token comes from the prefill; gains stop at max_new tokens."""
    B = drafter.block_size
    preds, h = ver.forward(prompt, 0)
    seq, hid = list(prompt), [h]          # hid: rows for seq[:-1] ... kept per verified token
    seq.append(preds[-1])                 # the target's first token: the first anchor
    steps = []
    while len(seq) - len(prompt) < max_new and seq[-1] not in stop:
        p = len(seq) - 1                  # anchor position
        ctx = np.concatenate(hid)[:p]     # hidden states strictly before the anchor
        ids = np.array(seq + [0] * (B - 1), dtype=np.int32)
        pad = np.zeros((len(ids), ctx.shape[1]), dtype=np.float32)
        pad[:p] = ctx
        draft = drafter.predict(ids, pad, np.array([p], dtype=np.int32))[0].tolist()
        preds, h = ver.forward([seq[-1]] + draft, p)
        a = 0
        while a < B - 1 and draft[a] == preds[a] and draft[a] not in stop:
            a += 1
        new = draft[:a] + [preds[a]]
        hid = [np.concatenate(hid)[:p], h[:a + 1]]
        steps.append(min(len(new), max_new - (len(seq) - len(prompt))))
        seq += new
    return seq[len(prompt):], steps


def teacher_forced(model, ids, layers, s, e):
    """One forward over the dataset sample: float32 hidden rows of the chosen
    layers, and how the PyTorch argmax compares with the dataset's tokens
    s..e-1 (llama.cpp's greedy answer): matches, and the first mismatch."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True)
    h = torch.cat([out.hidden_states[k + 1][0] for k in layers], -1).float().numpy()
    same = out.logits[0, s - 1:e - 1].argmax(-1).numpy() == ids[s:e]
    return h, int(same.sum()), int(same.size), int(np.argmin(same)) if not same.all() else int(same.size)


def greedy(model, prompt, n, stop):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=list(stop), pad_token_id=list(stop)[0],
                             attention_mask=torch.ones((1, len(prompt)), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def first_run(mask, max_new):
    """[s, e) of the answer: the first run of supervised tokens, cut at max_new."""
    s = int(np.argmax(mask))
    e = s
    while e < len(mask) and mask[e]:
        e += 1
    return s, min(e, s + max_new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target-dir", required=True)
    ap.add_argument("--data", required=True, help="tokenized held-out dataset")
    ap.add_argument("--hidden", required=True, help="its hidden-state store")
    ap.add_argument("--n", type=int, default=0, help="samples (0: all)")
    ap.add_argument("--max-new", type=int, default=128, help="the fetch's max tokens")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t = Target()
    model = t.model()
    with open(os.path.join(a.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["dflash_config"]["target_layer_ids"]
    embed = libdflash.SafeTensors(os.path.join(a.target_dir, "target.safetensors"))[
        "model.embed_tokens.weight"]
    tok = libdflash.Tokenizer(os.path.join(a.target_dir, "tokenizer.json"))
    stop = {t.eos, tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    rows, live_steps = [], []
    with libdflash.Trainer(cfg, embed, embed) as drafter, libdflash.Dataset(a.data) as ds, \
            libdflash.HiddenStore(a.hidden) as store:
        drafter.load(a.checkpoint)
        n = len(ds) if a.n <= 0 else min(a.n, len(ds))
        for i in range(n):
            sid, ids, mask = ds[i]
            ids, mask = np.array(ids), np.array(mask)
            s, e = first_run(mask, a.max_new)
            walk = drafter.walk(ids, mask, store.read(sid), max_tokens=a.max_new)
            h32, same, total, first = teacher_forced(model, ids, layers, s, e)
            forced = drafter.walk(ids, mask, h32, max_tokens=a.max_new)
            prompt = ids[:s].tolist()
            out, steps = speculate(Verifier(model, layers), drafter, prompt, a.max_new, stop)
            if i == 0:  # lossless: the same tokens as plain greedy decoding
                ref = greedy(model, prompt, len(out), stop)
                if ref[:len(out)] != out[:len(ref)]:
                    raise SystemExit(f"speculative output differs from greedy on {sid}")
            live_steps += steps
            rows.append({"id": sid, "walk_tokens": walk["tokens"], "walk_steps": walk["steps"],
                         "forced_tokens": forced["tokens"], "forced_steps": forced["steps"],
                         "live_tokens": sum(steps), "live_steps": len(steps),
                         "argmax_same": same, "argmax_total": total, "same_prefix": first})
            print(f"\rlive check {i + 1}/{n}: live tau {stats.ratio(live_steps, [1] * len(live_steps)):.3f}",
                  end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    res = summarize(rows, live_steps, cfg["block_size"])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    ag = res["agreement"]
    print(f"live tau {res['tau']:.4f} +- {res['tau_se']:.4f} over {res['steps']} verification "
          f"steps ({res['tokens']} tokens, {len(rows)} prompts); tokens per step 1..B: "
          f"{res['tokens_per_step_histogram']}\n"
          f"walk tau (dflash eval, same samples) {res['walk']['tau']:.4f} +- "
          f"{res['walk']['tau_se']:.4f}; teacher-forced fp32 walk {res['forced']['tau']:.4f}\n"
          f"live - walk = {ag['diff']:+.4f} +- {ag['diff_se']:.4f} (paired bootstrap): "
          f"{'agree' if ag['agree'] else 'DISAGREE'}\n"
          f"PyTorch argmax = dataset token (teacher forced) {res['argmax_agreement']:.4f}; "
          f"greedy continuations identical for a median {res['same_prefix_median']} tokens")


def summarize(rows, live_steps, B):
    col = lambda k: [r[k] for r in rows]  # noqa: E731
    m = {k: {"tokens": col(k + "_tokens"), "steps": col(k + "_steps")}
         for k in ("walk", "forced", "live")}
    (vw, vf, vl), (sw, sf, sl), _ = stats.bootstrap(
        [(m[k]["tokens"], m[k]["steps"]) for k in ("walk", "forced", "live")])
    return {
        "tau": vl, "tau_se": round(sl, 4), "steps": len(live_steps), "tokens": sum(live_steps),
        "prompts": len(rows),
        "tokens_per_step_histogram": np.bincount(live_steps, minlength=B + 1)[1:].tolist(),
        "walk": {"tau": vw, "tau_se": round(sw, 4), "steps": sum(col("walk_steps"))},
        "forced": {"tau": vf, "tau_se": round(sf, 4), "steps": sum(col("forced_steps"))},
        "agreement": stats.agreement("live", m["live"], "walk", m["walk"]),
        "forced_vs_walk": stats.agreement("forced", m["forced"], "walk", m["walk"]),
        "argmax_agreement": sum(col("argmax_same")) / max(sum(col("argmax_total")), 1),
        "same_prefix_median": float(np.median(col("same_prefix"))),
        "per_prompt": rows,
    }


if __name__ == "__main__":
    main()
