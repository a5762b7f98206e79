"""Live speculative decoding: the target (PyTorch) decodes greedily and
verifies the blocks a trained drafter (libdflash, dflash.Trainer.predict)
proposes; tau = mean tokens gained per verification step.

    python live_check.py --checkpoint out/drafter --target-dir out/target \
        --prompts out/heldout.jsonl --n 30 --max-new 128 -o out/live.json

Each step: the drafter gets the last verified token as its anchor and the
target's hidden states of every earlier token; the target runs the block
[anchor, d1..d(B-1)] in one forward pass (KV cache of the verified prefix);
drafted tokens are accepted while they equal the target's argmax, plus one
token from the target itself. Greedy verification is lossless: the output
equals plain greedy decoding (checked on the first prompt).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash  # noqa: E402
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
    """Greedy speculative decoding; returns (tokens, accepted-per-step list)."""
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
        seq += new
        steps.append(len(new))
    return seq[len(prompt):], steps


def greedy(model, prompt, n, stop):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=list(stop), pad_token_id=list(stop)[0],
                             attention_mask=torch.ones((1, len(prompt)), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target-dir", required=True)
    ap.add_argument("--prompts", required=True, help="held-out completion records (jsonl)")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t = Target()
    model = t.model()
    with open(os.path.join(a.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["dflash_config"]["target_layer_ids"]
    embed = dflash.SafeTensors(os.path.join(a.target_dir, "target.safetensors"))[
        "model.embed_tokens.weight"]
    tok = dflash.Tokenizer(os.path.join(a.target_dir, "tokenizer.json"))
    tmpl = dflash.ChatTemplate("smollm2")
    stop = {t.eos, tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    with open(a.prompts) as f:
        recs = [json.loads(ln) for ln in f][:a.n]
    all_steps, per_prompt = [], []
    with dflash.Trainer(cfg, embed, embed) as drafter:
        drafter.load(a.checkpoint)
        for i, rec in enumerate(recs):
            text = tmpl.render(rec["messages"], add_generation_prompt=True)
            prompt = tok.encode(text).tolist()
            out, steps = speculate(Verifier(model, layers), drafter, prompt, a.max_new, stop)
            if i == 0:  # lossless: the same tokens as plain greedy decoding
                ref = greedy(model, prompt, len(out), stop)
                if ref[:len(out)] != out[:len(ref)]:
                    raise SystemExit(f"speculative output differs from greedy on {rec['id']}")
            all_steps += steps
            per_prompt.append({"id": rec["id"], "tokens": len(out), "steps": len(steps),
                               "tau": sum(steps) / max(len(steps), 1)})
            print(f"\rlive check {i + 1}/{len(recs)}: tau so far "
                  f"{sum(all_steps) / max(len(all_steps), 1):.3f}", end="", file=sys.stderr,
                  flush=True)
    print(file=sys.stderr)
    hist = np.bincount(all_steps, minlength=cfg["block_size"] + 1)[1:].tolist()
    res = {"tau": sum(all_steps) / max(len(all_steps), 1), "steps": len(all_steps),
           "tokens": sum(all_steps), "prompts": len(recs),
           "tokens_per_step_histogram": hist, "per_prompt": per_prompt}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"live tau {res['tau']:.4f} over {res['steps']} verification steps "
          f"({res['tokens']} tokens, {len(recs)} prompts); tokens per step 1..B: {hist}")


if __name__ == "__main__":
    main()
