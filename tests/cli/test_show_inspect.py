#!/usr/bin/env python3
"""What a dataset holds, seen three ways that must agree with the stored arrays:
`dflash render --mask` shows exactly the ids and mask `dflash tokenize` stores (same
defaults); `dflash show` prints a sample with its supervised runs between [[ ]] (Hugging Face
`tokenizers` decodes the runs independently); `dflash inspect DATASET` summarises it (counts
recomputed from the shards with the safetensors package). Needs DFLASH_CLI, the qwen2
tokenizer fixture, `tokenizers` and `safetensors` (exit 77 without)."""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "chat"))
import hf_jinja  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
TOK = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
CONV = {"id": "conv-1", "messages": [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Add two and two.", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "Three plus three is six.", "content": "6."}]}


def cli(*args, stdin=None, check=True):
    r = subprocess.run([CLI, *map(str, args)], input=stdin, capture_output=True, text=True)
    assert not check or r.returncode == 0, (args, r.stderr)
    return r


def stored(out):
    """(ids, mask, sample ids) of every sample, read with the safetensors package."""
    from safetensors.numpy import load_file
    from safetensors import safe_open
    samples = []
    for shard in sorted(glob.glob(str(out / "*.safetensors"))):
        t = load_file(shard)
        with safe_open(shard, "np") as f:
            names = json.loads(f.metadata()["sample_ids"])
        off = t["offsets"]
        for i, name in enumerate(names):
            samples.append((t["input_ids"][off[i]:off[i + 1]].tolist(),
                            t["loss_mask"][off[i]:off[i + 1]].tolist(), name))
    return samples


def runs(ids, mask):
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def main():
    try:
        from tokenizers import Tokenizer  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError:
        print("SKIP: needs tokenizers and safetensors")
        sys.exit(77)
    if not CLI or not (TOK / "vocab.json").exists():
        print("SKIP: needs DFLASH_CLI and the qwen2 tokenizer fixture")
        sys.exit(77)
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers import pre_tokenizers, decoders
    hf = Tokenizer(BPE.from_file(str(TOK / "vocab.json"), str(TOK / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    added = json.loads((TOK / "added_tokens.json").read_text())
    hf.add_special_tokens(sorted(added, key=added.get))  # appended in id order: same ids
    assert all(hf.token_to_id(t) == i for t, i in added.items())
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        src = d / "in.jsonl"
        src.write_text(json.dumps(CONV) + "\n")
        for template in ("kimi-k2.6", "qwen3"):
            out = d / template
            cli("tokenize", "--tokenizer", TOK, "--template", template,
                "--allow-split-control-tokens", "-o", out, src)
            (ids, mask, name), = stored(out)
            assert name == "conv-1"
            shown = json.loads(cli("render", "--template", template, "--tokenizer", TOK,
                                   "--mask", stdin=json.dumps(CONV)).stdout)
            assert shown["ids"] == ids and shown["loss_mask"] == mask, template
            assert "Three plus three is six." in shown["text"], template  # kept, as stored
        out = d / "qwen3"
        (ids, mask, name), = stored(out)
        text = cli("show", out, "--index", 0, "--tokenizer", TOK, "--no-color").stdout
        head, body = text.split("\n", 1)
        assert head == f"# sample 0, id conv-1: {len(ids)} tokens, {sum(mask)} supervised"
        body = body[:-1]
        assert body.replace("[[", "").replace("]]", "") == hf.decode(ids,
                                                                     skip_special_tokens=False)
        got = [seg.split("]]", 1)[0] for seg in body.split("[[")[1:]]
        assert got == [hf.decode(r, skip_special_tokens=False) for r in runs(ids, mask)], got
        assert "6." in got[-1]
        assert cli("show", out, "--id", "conv-1", "--tokenizer", TOK, "--no-color").stdout == text
        coloured = cli("show", out, "--index", 0, "--tokenizer", TOK, "--color").stdout
        assert "\033[1;32m" in coloured and "[[" not in coloured
        plain = cli("show", out, "--index", 0, "--no-color").stdout.split("\n")[1]
        want = " ".join(("[[" if m and (i == 0 or not mask[i - 1]) else "") + str(t) +
                        ("]]" if m and (i + 1 == len(ids) or not mask[i + 1]) else "")
                        for i, (t, m) in enumerate(zip(ids, mask)))
        assert plain == want
        r = cli("show", out, "--id", "nope", check=False)
        assert r.returncode == 1 and "nope" in r.stderr
        # A file edited without changing an id is the same tokenizer (it was refused).
        same = Path(tmp) / "same-tok"
        shutil.copytree(TOK, same)
        with open(same / "special_tokens_map.json", "a") as f:
            f.write("\n")
        r = cli("show", out, "--index", 0, "--tokenizer", same, "--no-color")
        assert r.stdout == text
        # Another tokenizer than the one tokenize used (here: a merge less) is refused,
        # naming both hashes, unless --allow-tokenizer-mismatch (it printed garbage, exit 0).
        other = Path(tmp) / "other-tok"
        shutil.copytree(TOK, other)
        merges = (other / "merges.txt").read_text(encoding="utf-8").splitlines(True)
        (other / "merges.txt").write_text("".join(merges[:-1]), encoding="utf-8")
        r = cli("show", out, "--index", 0, "--tokenizer", other, "--no-color", check=False)
        assert r.returncode == 1 and "another tokenizer" in r.stderr, r.stderr
        assert r.stderr.count("sha256:") == 2 and r.stdout == "", r
        r = cli("show", out, "--index", 0, "--tokenizer", other, "--no-color",
                "--allow-tokenizer-mismatch")
        assert r.stdout == text
        # train and eval check --target's tokenizer files the same way, before any work.
        for target, refused in ((other, True), (TOK, False), (Path(tmp), False)):
            for cmd in (["train", "-o", Path(tmp) / "run", "--config", "missing.json"],
                        ["eval", "--checkpoint", "nowhere"]):
                r = cli(*cmd, "--target", target, "--data", out, "--hidden", "nowhere",
                        check=False)
                assert r.returncode == 1, r
                assert ("another tokenizer" in r.stderr) == refused, (cmd, target, r.stderr)
        # A dataset written before the hash was the tokenizer's identity (its manifest holds
        # the hash of the files' bytes) still matches the files it was made with.
        old = hashlib.sha256()
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                     "added_tokens.json", "special_tokens_map.json", "tiktoken.model"):
            if (TOK / name).is_file():
                data = (TOK / name).read_bytes()
                old.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        manifest = json.loads((out / "dataset.json").read_text())
        manifest["tokenizer_hash"] = "sha256:" + old.hexdigest()
        (out / "dataset.json").write_text(json.dumps(manifest))
        assert cli("show", out, "--index", 0, "--tokenizer", TOK, "--no-color").stdout == text
        r = cli("show", out, "--index", 0, "--tokenizer", other, "--no-color", check=False)
        assert r.returncode == 1 and "another tokenizer" in r.stderr, r.stderr
        # inspect: a summary, not the tensors and a line of every id.
        summary = cli("inspect", out).stdout
        assert f"1 samples, {len(ids)} tokens" in summary, summary
        assert f"supervised {sum(mask)} " in summary and "template qwen3" in summary
        assert "sha256:" in summary and "length histogram" in summary
        assert "sample_ids" not in summary
    print("render --mask == tokenize, show, inspect: OK")


if __name__ == "__main__":
    main()
