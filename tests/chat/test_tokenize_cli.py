#!/usr/bin/env python3
"""`dflash tokenize` end to end: the output is the same bytes for any thread
count and batch size, every line is accounted for (sample or rejection with its
file and line), and the manifest's tokenizer_hash is the SHA-256 that hashlib
computes over the tokenizer files with the framing dataset.h documents.
Needs DFLASH_CLI and the qwen2 tokenizer fixture (exit 77 without)."""
import filecmp
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_conversations  # noqa: E402
import hf_jinja  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
TOK = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
HASHED = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
          "added_tokens.json", "special_tokens_map.json", "tiktoken.model"]


def expected_hash(d):
    h = hashlib.sha256()
    for name in HASHED:
        p = d / name
        if p.is_file():
            data = p.read_bytes()
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()


def write_inputs(d):
    """Two files: generated conversations, interleaved with bad and blank lines."""
    bad = ["{not json", "[]", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
           json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
           json.dumps({"messages": [{"role": "user", "content": 3}]}), "", "\"\\ud800\"",
           json.dumps({"messages": [{"role": "user", "content": "e\u0301"},
                                    {"role": "assistant", "content": "A\u030a \u1100\u1161"}]})]
    lines = []
    for i, (msgs, tools) in enumerate(gen_conversations.corpus(900, seed=31)):
        obj = {"messages": msgs, "tools": tools} if tools else {"messages": msgs}
        if i % 7 == 0:  # fetcher record: the last assistant turn as "completion"
            if msgs and msgs[-1]["role"] == "assistant":
                obj = dict(obj, messages=msgs[:-1], completion=msgs[-1])
        lines.append(json.dumps(obj, ensure_ascii=False))
        if i % 50 == 0:
            lines.append(bad[(i // 50) % len(bad)])
    paths = [d / "a.jsonl", d / "b.jsonl"]
    half = len(lines) // 2
    paths[0].write_text("\n".join(lines[:half]) + "\n", encoding="utf-8")
    paths[1].write_text("\n".join(lines[half:]) + "\n", encoding="utf-8")
    return paths, len(lines) - sum(1 for x in lines if not x)


def tokenize(out, inputs, *extra):
    r = subprocess.run([CLI, "tokenize", "--tokenizer", str(TOK), "--template", "qwen3",
                        "-o", str(out), *extra, *map(str, inputs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stderr


def same_tree(a, b):
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only, (cmp.left_only, cmp.right_only)
    names = sorted(cmp.common_files)
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    return names


def main():
    if not CLI or not (TOK / "vocab.json").exists():
        print("SKIP: needs DFLASH_CLI and the qwen2 tokenizer fixture")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        inputs, n_lines = write_inputs(d)
        runs = {}
        for threads, batch in ((1, "2048"), (2, "2048"), (3, "2048"), (2, "37"), (3, "1")):
            out = d / f"t{threads}-b{batch}"
            log = tokenize(out, inputs, "--threads", str(threads), "--batch-lines", batch)
            runs[threads, batch] = out
        base = runs[1, "2048"]
        for key, out in runs.items():
            names = same_tree(base, out)
            print(f"threads={key[0]} batch-lines={key[1]}: {len(names)} files identical to "
                  f"1 thread")
        manifest = json.loads((base / "dataset.json").read_text())
        rejected = [json.loads(x) for x in (base / "rejected.jsonl").read_text().splitlines()]
        print(log.strip().splitlines()[-1])
        assert manifest["tokenizer_hash"] == expected_hash(TOK), manifest["tokenizer_hash"]
        assert manifest["options"] == {"reasoning": "keep_after_last_user", "turns": "all",
                                       "max_len": 0, "truncate": False, "nfc": True}
        assert manifest["samples"] + len(rejected) == n_lines, (manifest["samples"],
                                                                len(rejected), n_lines)
        assert len(manifest["shards"]) == 1 and manifest["samples"] > 500
        for r in rejected:  # every rejection names its file, line and reason
            assert r["file"] in map(str, inputs) and r["line"] > 0 and r["reason"], r
        reasons = " | ".join(r["reason"] for r in rejected)
        for needle in ("invalid JSON", "unknown role", "no assistant turn", "content"):
            assert needle in reasons, needle
        # Over-long samples: dropped by default, cut with --truncate.
        tokenize(d / "drop", inputs, "--max-len", "64")
        tokenize(d / "cut", inputs, "--max-len", "64", "--truncate")
        drop = json.loads((d / "drop" / "dataset.json").read_text())
        cut = json.loads((d / "cut" / "dataset.json").read_text())
        assert cut["samples"] == manifest["samples"] and cut["tokens"] <= 64 * cut["samples"]
        assert drop["samples"] < manifest["samples"]
        assert all(s["tokens"] <= 64 * s["samples"] for s in drop["shards"])
        print(f"max-len 64: {drop['samples']} kept when dropping, {cut['samples']} when "
              f"truncating")
    print("tokenize CLI: OK")


if __name__ == "__main__":
    main()
