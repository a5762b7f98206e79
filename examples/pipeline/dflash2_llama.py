"""A DFlash 2 checkpoint written by libdflash, served by llama.cpp (b11434):

  1. the target's greedy answers to a few prompts (llama-server), tokenized,
     and their hidden states (dump_hidden.py), as the pipeline makes them
  2. `dflash train --config` on them, with a DFlash2DraftModel config (trained2) and with
     the same drafter as DFlash 1 (backbone1)
  3. checkpoints derived from them with libdflash.Trainer (set_parameters + save):
       identity2   backbone1's tensors with fresh (identity) conv and selector tensors
       base2       trained2's backbone with fresh conv and selector tensors
       conv2       trained2's backbone and convolutions, a fresh selector
     (A DFlash 2 backbone alone, its convolutions removed, is no working DFlash 1 drafter:
     llama.cpp accepted 0 of 2149 of its drafts. So identity2 is built from a DFlash 1
     training.)
  4. each converted by llama.cpp's convert_hf_to_gguf.py; the GGUF read back
     with llama.cpp's gguf-py: the conv / selector tensors with their shapes
     and our values, the four sizes in the metadata
  5. llama_spec.py: llama-server --spec-type draft-dflash on LLAMA_PROMPTS of
     the same prompts (DFlash 2 drafting runs at ~1 token/s on this loaded
     2-core machine: the drafter's LM head and selector over 49,152 tokens)

and checks what llama.cpp does with our tensors:
  - every drafter loads, and the speculative output equals the plain run's
    tokens (greedy is lossless);
  - identity2 drafts exactly as backbone1 (the same accepted tokens on every
    prompt): llama.cpp reads identity conv/selector tensors as plain DFlash;
  - conv2 differs from base2 (the convolutions reach the draft) and
    trained2 from conv2 (the selector decides the drafted tokens at decode
    time: llama.cpp walks the selector's lattice, greedy);
  - llama.cpp's tokens per target decode equal libdflash's walk (the
    selector's greedy path, libdflash.Trainer.walk) on the same samples,
    within 3 standard errors of the paired difference or 0.02.

The prompts (counting, repeating) are the training prompts: a drafter trained
for minutes on 10 such answers is accepted often enough for the differences to
show; held-out quality is the demo's business (pipeline.py --arch both).

    python examples/pipeline/dflash2_llama.py --build BUILD --out DIR [--check]

--check: exit 77 when the model package, PyTorch or llama-server is missing.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import llama_spec  # noqa: E402
import pipeline  # noqa: E402
import stats  # noqa: E402
from pipeline import log, run  # noqa: E402

# Smaller selector than the demo's (z-lab's released 16 / 256), other sizes
# than the demo checks, and cheap to train here.
SIZES = dict(conv_kernel_size=2, conv_group_size=16, selector_top_k=8, selector_rank=32)
N_PROMPTS, MAX_TOKENS, EPOCHS, LAYERS, LLAMA_PROMPTS = 10, 48, 8, "1,14,27", 10
DF2_PARTS = ("attention_conv.", "mlp_conv.", "candidate_selector.")
# Answers a drafter trained for minutes predicts: counting and repeating (on
# the pipeline's prompts this short training drafts nothing llama.cpp accepts,
# and every equality below would hold trivially).
PROMPTS = ["Count from 1 to 40, separated by commas.", "Repeat the word 'hello' 20 times.",
           "List the letters of the alphabet separated by spaces.",
           "Write the multiples of 5 from 5 to 100.", "Count down from 30 to 1.",
           "Write 'ABC' ten times, separated by spaces.", "List the even numbers from 2 to 60.",
           "Write the days of the week, three times over.", "Count from 100 to 130.",
           "Repeat 'yes, no' 15 times."]
CONV_PARTS = ("attention_conv.", "mlp_conv.")


def make_data(dflash_cli, t, target_dir, ldir, out):
    """The pipeline's stages 1-4 on the first N_PROMPTS prompts, all for training."""
    urls, procs = pipeline.start_servers("llama", 1, 1, target_dir, t.path, ldir, out)
    try:
        src = os.path.join(out, "prompts-source.jsonl")
        with open(src, "w") as f:
            for i, text in enumerate(PROMPTS[:N_PROMPTS]):
                f.write(json.dumps({"id": f"pattern-{i:03d}",
                                    "messages": [{"role": "user", "content": text}]}) + "\n")
        pipeline.split_prompts(src, N_PROMPTS, N_PROMPTS + 1, out)
        run([dflash_cli, "fetch", "--server", urls[0], "--model", "smollm2", "--family", "none",
             "--temperature", "0", "--max-tokens", MAX_TOKENS, "--extra",
             '{"repeat_penalty": 1.0}', os.path.join(out, "prompts.jsonl"),
             "-o", os.path.join(out, "fetch")], stdout=subprocess.DEVNULL)
    finally:
        for p in procs:
            llama_spec.stop(p)
    files, counts = pipeline.split_completions([os.path.join(out, "fetch")], set(), out)
    assert counts["train"] == N_PROMPTS, counts
    data, hidden = os.path.join(out, "data"), os.path.join(out, "hidden")
    shutil.rmtree(data, ignore_errors=True)
    run([dflash_cli, "tokenize", "--tokenizer", os.path.join(target_dir, "tokenizer.json"),
         "--template", "smollm2", "--keep-unfinished", "-o", data, files["train"]])
    shutil.rmtree(hidden, ignore_errors=True)
    run([sys.executable, os.path.join(HERE, "dump_hidden.py"), "--data", data, "--out", hidden,
         "--layers", LAYERS])
    return data, hidden


def derive(libdflash, cfg1, cfg2, embed, trained, trained1, out):
    """The derived checkpoints (module docstring), every one saved by libdflash."""
    with libdflash.Trainer(cfg1, embed, embed, seed=0) as one:
        one.load(trained1)
        backbone1 = one.parameters()
    with libdflash.Trainer(cfg2, embed, embed, seed=0) as fresh:
        assert set(backbone1) < set(fresh.names()), "DFlash 1 and 2 backbones differ in names"
        fresh.set_parameters(backbone1)
        fresh.save(os.path.join(out, "identity2"))
    with libdflash.Trainer(cfg2, embed, embed, seed=0) as fresh, \
            libdflash.Trainer(cfg2, embed, embed, seed=0) as tr:
        tr.load(trained)
        p_tr = tr.parameters()
        backbone = {k: v for k, v in p_tr.items() if not any(s in k for s in DF2_PARTS)}
        assert len(backbone) < len(p_tr), "no DFlash 2 tensors in the trained checkpoint"
        fresh.set_parameters(backbone)
        fresh.save(os.path.join(out, "base2"))
        fresh.set_parameters({k: v for k, v in p_tr.items() if any(s in k for s in CONV_PARTS)})
        fresh.save(os.path.join(out, "conv2"))


def convert(ldir, ckpt, target_dir, gguf):
    with open(gguf + ".convert.log", "w") as lf:
        run([sys.executable, os.path.join(ldir, "src", "convert_hf_to_gguf.py"), ckpt,
             "--target-model-dir", target_dir, "--outtype", "f32", "--outfile", gguf],
            stdout=lf, stderr=subprocess.STDOUT)


def gguf_tensors(ldir, path):
    """{name: array (numpy order)}, {key: value} of a GGUF, read by llama.cpp's gguf-py."""
    sys.path.insert(0, os.path.join(ldir, "src", "gguf-py"))
    import gguf
    r = gguf.GGUFReader(path)
    meta = {k: f.parts[f.data[0]].tolist() for k, f in r.fields.items()
            if k.startswith("dflash.") and f.data}
    return {t.name: np.asarray(t.data) for t in r.tensors}, meta


def check_gguf(libdflash, ldir, path, ckpt, cfg2):
    """The DFlash 2 tensors under llama.cpp's names, with z-lab's shapes and
    the values of our checkpoint (model.safetensors, as the converter reads it)."""
    H, V = cfg2["hidden_size"], cfg2["vocab_size"]
    k, g, r = SIZES["conv_kernel_size"], SIZES["conv_group_size"], SIZES["selector_rank"]
    tensors, meta = gguf_tensors(ldir, path)
    want = {"selector_predecessor.weight": ("candidate_selector.predecessor_codebook", (V, r)),
            "selector_successor.weight": ("candidate_selector.successor_codebook", (V, r)),
            "selector_hidden.weight": ("candidate_selector.hidden_projection.weight", (r, H))}
    for i in range(cfg2["num_hidden_layers"]):
        for ours, theirs in (("attention_conv", "attn_conv"), ("mlp_conv", "ffn_conv")):
            want[f"blk.{i}.{theirs}_base"] = (f"layers.{i}.{ours}.base_kernel", (2, k, H))
            want[f"blk.{i}.{theirs}_proj.weight"] = (
                f"layers.{i}.{ours}.kernel_projection.weight", (2 * k * H // g, H))
    st = libdflash.SafeTensors(os.path.join(ckpt, "model.safetensors"))
    for gname, (name, shape) in want.items():
        assert gname in tensors, f"{path}: no tensor {gname} (has {sorted(tensors)})"
        src = st[name] if name in st else st["model." + name]
        assert tuple(src.shape) == shape, f"{name}: ours {src.shape}, z-lab {shape}"
        assert tensors[gname].shape == shape, f"{gname}: GGUF {tensors[gname].shape}, z-lab {shape}"
        assert np.array_equal(tensors[gname], src), f"{gname}: values differ from {name}"
    for key in SIZES:
        assert meta.get("dflash." + key) == [SIZES[key]], f"dflash.{key}: {meta.get('dflash.' + key)}"
    return sorted(want)


def walk_rows(libdflash, ckpt, target_dir, data, hidden):
    """libdflash's speculative walk (greedy selector path) per sample."""
    rows = {}
    with libdflash.Trainer.from_checkpoint(ckpt, os.path.join(target_dir, "target.safetensors")) \
            as tr, libdflash.Dataset(data) as ds, libdflash.HiddenStore(hidden) as hs:
        for sid, ids, mask in ds:
            w = tr.walk(np.asarray(ids), np.asarray(mask), hs.read(sid), max_tokens=MAX_TOKENS)
            rows[sid] = (w["tokens"], w["steps"])
    return rows


def per_prompt(rows):
    return [(r["id"], r["accepted"], r["drafted"], r["steps"], r["predicted_n"]) for r in rows]


def checks(res, spec, walk, out):
    c, pp = spec["configs"], spec["per_prompt"]
    n = spec["samples"]
    for name, s in c.items():
        if name != "plain":
            assert s["same_as_plain"] == n, f"{name}: {s['same_as_plain']}/{n} outputs equal plain"
    # A trained backbone is accepted (else the equalities below are trivial).
    assert c["backbone1"]["accepted"] > 0 and c["trained2"]["accepted"] > 0, c
    assert per_prompt(pp["identity2"]) == per_prompt(pp["backbone1"]), \
        "identity DFlash 2 drafts differently from DFlash 1 with the same backbone"
    res["conv_changes"] = sum(a != b for a, b in zip(per_prompt(pp["conv2"]),
                                                      per_prompt(pp["base2"])))
    res["selector_changes"] = sum(a != b for a, b in zip(per_prompt(pp["trained2"]),
                                                          per_prompt(pp["conv2"])))
    assert res["conv_changes"] > 0, "the trained convolutions did not change llama.cpp's drafts"
    assert res["selector_changes"] > 0, "the trained selector did not change llama.cpp's drafts"
    rows = [r for r in pp["trained2"] if r["id"] in walk]
    assert len(rows) == n, (len(rows), n)
    w = res["llama_vs_walk"] = stats.agreement(
        "llama_cpp", {"tokens": [r["predicted_n"] - 1 for r in rows],
                      "steps": [r["predicted_n"] - 1 - r["accepted"] for r in rows]},
        "walk", {"tokens": [walk[r["id"]][0] for r in rows],
                 "steps": [walk[r["id"]][1] for r in rows]})
    assert abs(w["diff"]) <= max(3 * w["diff_se"], 0.02), f"llama.cpp vs libdflash walk: {w}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default="out-dflash2-llama")
    ap.add_argument("--llama-dir", default=None)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    missing = pipeline.missing_packages(a.llama_dir)
    if missing:
        print(f"skip: missing {missing} (pip install -r scripts/requirements.txt; "
              "scripts/llama_server.sh builds llama-server)")
        sys.exit(77 if a.check else 1)
    out = os.path.abspath(a.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ldir = llama_spec.llama_dir(a.llama_dir)
    dflash_cli = os.path.join(a.build, "tools", "dflash", "dflash")
    os.environ.setdefault("DFLASH_LIBRARY", os.path.join(a.build, "libdflash.so"))
    py = os.path.join(ROOT, "bindings", "python")
    sys.path.insert(0, py)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [py, os.environ.get("PYTHONPATH")]))
    import libdflash
    from target import Target

    log("target, its answers and hidden states")
    t = Target()
    target_dir = t.export(os.path.join(out, "target"))
    data, hidden = make_data(dflash_cli, t, target_dir, ldir, out)

    log("train a DFlash 2 drafter (dflash train --config, DFlash2DraftModel)")
    cfg1 = pipeline.drafter_config(t, [int(x) for x in LAYERS.split(",")], 8)
    cfg2 = pipeline.dflash2_config(cfg1)
    cfg2["dflash_config"].update(SIZES)
    cfg_path = os.path.join(out, "drafter2.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg2, f, indent=2)
    trained = os.path.join(out, "trained2")
    train_args = ["--target", target_dir, "--data", data, "--hidden", hidden, "--epochs", EPOCHS,
                  "--anchors", 8, "--lr", 5e-3, "--warmup-ratio", "0.05", "--seed", 0, "--quiet"]
    run([dflash_cli, "train", "--config", cfg_path, "-o", trained] + train_args)
    log("train a DFlash 1 drafter of the same backbone on the same data")
    cfg1_path = os.path.join(out, "drafter1.json")
    with open(cfg1_path, "w") as f:
        json.dump(cfg1, f, indent=2)
    trained1 = os.path.join(out, "backbone1")
    run([dflash_cli, "train", "--config", cfg1_path, "-o", trained1] + train_args)
    embed = libdflash.SafeTensors(os.path.join(target_dir, "target.safetensors"))[
        "model.embed_tokens.weight"]
    derive(libdflash, cfg1, cfg2, embed, trained, trained1, out)

    log("convert with llama.cpp's convert_hf_to_gguf.py; read the GGUF back")
    names = ("backbone1", "identity2", "base2", "conv2", "trained2")
    for name in names:
        convert(ldir, os.path.join(out, name), target_dir, os.path.join(out, name + ".gguf"))
    res = {"sizes": SIZES, "gguf_tensors": check_gguf(libdflash, ldir,
                                                      os.path.join(out, "trained2.gguf"),
                                                      trained, cfg2)}
    print(f"trained2.gguf: {len(res['gguf_tensors'])} DFlash 2 tensors, shapes and values equal")

    log("llama-server --spec-type draft-dflash with each")
    spec_json = os.path.join(out, "llama_spec.json")
    run([sys.executable, os.path.join(HERE, "llama_spec.py"), "--llama-dir", ldir,
         "--target-gguf", t.path, "--data", data, "--max-new", MAX_TOKENS, "--block-size", 8,
         "--n", LLAMA_PROMPTS, "--config", "plain="] +
        [x for nm in names for x in ("--config", f"{nm}={os.path.join(out, nm + '.gguf')}")] +
        ["-o", spec_json])
    with open(spec_json) as f:
        spec = json.load(f)
    walk = walk_rows(libdflash, trained, target_dir, data, hidden)
    res["configs"] = {k: {kk: v.get(kk) for kk in ("accepted", "drafted", "acceptance",
                                                     "tokens_per_step", "tokens_per_step_se",
                                                     "tokens_per_decode", "same_as_plain")}
                      for k, v in spec["configs"].items()}
    try:
        checks(res, spec, walk, out)
    finally:
        with open(os.path.join(out, "dflash2_llama.json"), "w") as f:
            json.dump(res, f, indent=2)
        print(json.dumps(res, indent=1))
    print("check ok: llama.cpp loads libdflash's DFlash 2 GGUF and drafts with its conv and "
          "selector tensors")


if __name__ == "__main__":
    main()
