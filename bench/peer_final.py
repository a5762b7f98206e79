"""speculators' inputs for bench/peer_trainers.py, made in the demo's PyTorch venv
(.venv-ref: examples/pipeline/target.py loads SmolLM2 from its GGUF file):

- DIR/verifier/: the target as speculators reads its verifier (config.json, tokenizer
  files and model.safetensors with model.embed_tokens.weight, lm_head.weight (tied: the
  embedding) and model.norm.weight);
- DIR/data/: the offline dataset (bench/peer_adapters.speculators_dataset) whose
  hs_{i}.safetensors carry the target's final layer before its final norm, from a
  fresh float32 forward (what vLLM captures; speculators trains on its logits).

    python3 bench/peer_final.py --out OUT --dir WORK/speculators [--limit N]
"""
import argparse
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pipeline"))
sys.path.insert(0, HERE)
from target import Target  # noqa: E402
import peer_adapters  # noqa: E402


def verifier(t, model, out_dir, target_dir):
    os.makedirs(out_dir, exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(target_dir, f), out_dir)
    emb = model.model.embed_tokens.weight.detach().float().numpy()
    norm = model.model.norm.weight.detach().float().numpy()
    peer_adapters.write_safetensors(os.path.join(out_dir, "model.safetensors"), {
        "model.embed_tokens.weight": ("F32", emb.shape, emb.tobytes()),
        "lm_head.weight": ("F32", emb.shape, emb.tobytes()),
        "model.norm.weight": ("F32", norm.shape, norm.tobytes())})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the demo's output folder")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--limit", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t = Target()
    model = t.model()
    verifier(t, model, os.path.join(a.dir, "verifier"), os.path.join(a.out, "target"))
    norm, model.model.norm = model.model.norm, torch.nn.Identity()  # the raw last layer

    def final_rows(_sid, ids):
        with torch.no_grad():
            out = model.model(torch.as_tensor(np.array(ids), dtype=torch.long)[None],
                              output_hidden_states=True, use_cache=False)
        return out.hidden_states[-1][0].float().numpy()

    n = peer_adapters.speculators_dataset(os.path.join(a.out, "data", "train"),
                                          os.path.join(a.out, "hidden", "train"),
                                          os.path.join(a.dir, "data"), final_rows, a.limit)
    model.model.norm = norm
    print(f"speculators inputs: {n} samples in {a.dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
