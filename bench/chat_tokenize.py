#!/usr/bin/env python3
"""Throughput of render + tokenize + loss mask: the Python path (jinja2 over the
official qwen3 template as HF configures it, HF `tokenizers` over the Qwen
fixture, SpecForge-style mask from a text search) versus `dflash tokenize`
(one thread) on the same JSONL. Prints samples/s of each and the ratio.
Usage: DFLASH_LIBRARY=... DFLASH_CLI=... PYTHONPATH=bindings/python python3 bench/chat_tokenize.py [N]"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "chat"))
import gen_conversations  # noqa: E402
import hf_jinja  # noqa: E402
import test_masks  # noqa: E402


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    fx = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
    corpus = [c for c in gen_conversations.corpus(n, seed=7)]
    ref = hf_jinja.Reference()
    tok = test_masks.QwenTok(fx)
    t0 = time.perf_counter()
    done = 0
    for msgs, tools in corpus:
        try:
            text = ref.render("qwen3", msgs, tools=tools)
        except Exception:
            continue
        enc = tok.tok.encode(text, add_special_tokens=False)
        data = text.encode()
        # SpecForge-style: char spans by search, tokens mapped by offsets.
        test_masks.specforge_mask("qwen3", data, [o[0] for o in enc.offsets],
                                  [o[1] for o in enc.offsets])
        done += 1
    py_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / "in.jsonl"
        with open(src, "w") as f:
            for msgs, tools in corpus:
                f.write(json.dumps({"messages": msgs, "tools": tools} if tools else
                                   {"messages": msgs}, ensure_ascii=False) + "\n")
        cli = os.environ.get("DFLASH_CLI", str(ROOT / "build" / "tools" / "dflash" / "dflash"))
        t0 = time.perf_counter()
        subprocess.run([cli, "tokenize", "--tokenizer", str(fx), "--template", "qwen3",
                        "--reasoning", "official", "-o", str(pathlib.Path(d) / "ds"), str(src)],
                       check=True, capture_output=True)
        c_s = time.perf_counter() - t0
    print(f"python (jinja2 + tokenizers + search mask): {done / py_s:10.0f} samples/s")
    print(f"dflash tokenize (1 thread, incl. load):     {done / c_s:10.0f} samples/s")
    print(f"ratio: {py_s / c_s:.1f}x")


if __name__ == "__main__":
    main()
