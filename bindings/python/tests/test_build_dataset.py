"""libdflash.build_dataset (dflash_dataset_build) against `dflash tokenize`: the same
input and options give the same directory, byte for byte, and the same counts; the
refusals raise with the stats attached; progress and stopping; the reasoning-mode names
come from the library (chat.h), once."""
import filecmp
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import libdflash

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "chat"))
import gen_conversations  # noqa: E402

FIX = pathlib.Path(os.environ.get("DFLASH_FIXTURES", ROOT / ".." / "shared" / "fixtures"))
TOK = FIX / "tokenizers" / "qwen2"
CLI = os.environ.get("DFLASH_CLI")
BAD = ["{not json", "[]", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
       json.dumps({"messages": [{"role": "user", "content": "no answer"}]}), ""]

needs_fixture = pytest.mark.skipif(not (TOK / "vocab.json").exists(),
                                   reason="qwen2 tokenizer fixture missing")


def write_inputs(d, n=300):
    """Two files of generated conversations (ids on every third), bad and blank lines, and a
    repeated id."""
    lines = []
    for i, (msgs, tools) in enumerate(gen_conversations.corpus(n, seed=7)):
        obj = {"messages": msgs, "tools": tools} if tools else {"messages": msgs}
        if i % 3 == 0:
            obj["id"] = f"rec-{i}"
        lines.append(json.dumps(obj, ensure_ascii=False))
        if i % 25 == 0:
            lines.append(BAD[(i // 25) % len(BAD)])
    lines.append(lines[0])  # rec-0 again: a duplicate id
    paths = [d / "a.jsonl", d / "b.jsonl"]
    paths[0].write_text("\n".join(lines[:n // 2]) + "\n", encoding="utf-8")
    paths[1].write_text("\n".join(lines[n // 2:]) + "\n", encoding="utf-8")
    return paths


def same_tree(a, b):
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only, (cmp.left_only, cmp.right_only)
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    return sorted(cmp.common_files)


# (CLI arguments, the same options as build_dataset keywords)
CASES = [
    ([], {}),
    (["--max-len", "64"], {"max_len": 64}),
    (["--max-len", "64", "--truncate"], {"max_len": 64, "truncate": True}),
    (["--last-turn-only", "--reasoning", "drop", "--threads", "3", "--batch-lines", "7"],
     {"last_turn_only": True, "reasoning": "drop", "threads": 3, "batch_lines": 7}),
    (["--reasoning", "keep_all"], {"reasoning": "keep_all", "threads": 1}),
]


@needs_fixture
@pytest.mark.skipif(not CLI, reason="needs DFLASH_CLI")
@pytest.mark.parametrize("cli_args,kwargs", CASES)
def test_build_dataset_equals_cli(tmp_path, cli_args, kwargs):
    inputs = write_inputs(tmp_path)
    common = ["--tokenizer", str(TOK), "--template", "qwen3", "--allow-split-control-tokens",
              "--max-reject-ratio", "0.9"]  # --max-len 64 drops 85 % of the lines
    r = subprocess.run([CLI, "tokenize", *common, *cli_args, "-o", str(tmp_path / "cli"),
                        *map(str, inputs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    stats = libdflash.build_dataset([str(p) for p in inputs], tmp_path / "py", TOK, "qwen3",
                                    allow_split_control_tokens=True, max_reject_ratio=0.9,
                                    **kwargs)
    names = same_tree(tmp_path / "cli", tmp_path / "py")
    assert names == ["dataset.json", "rejected.jsonl", "shard-00000.safetensors",
                     "sources.jsonl"]
    # The CLI's summary line prints the counts the library returns.
    line = [x for x in r.stderr.splitlines() if x.startswith("tokenize: ") and "samples" in x][-1]
    got = dict(zip(("samples", "tokens", "rejected", "too_long"),
                   map(int, re.findall(r"(\d+) (?:samples|tokens|rejected|too long)", line))))
    assert got == {k: stats[k] for k in got}, (line, stats)
    dropping = kwargs.get("max_len") and not kwargs.get("truncate")
    assert stats["verdict"] == "ok" and stats["samples"] > (10 if dropping else 200)
    lines = [x for p in inputs for x in p.read_bytes().split(b"\n")[:-1]]  # not splitlines:
    assert stats["lines"] == len(lines)  # U+2028 in a JSON string does not end a line
    assert stats["samples"] + stats["rejected"] == len([x for x in lines if x])
    if dropping:
        assert stats["too_long"] > 200


@needs_fixture
def test_build_dataset_refusals(tmp_path):
    inputs = write_inputs(tmp_path, n=60)
    args = dict(tokenizer=TOK, template="qwen3", allow_split_control_tokens=True)
    with pytest.raises(libdflash.FormatError) as e:  # the default max_reject_ratio 0.05
        libdflash.build_dataset(inputs, tmp_path / "ratio", **args)
    assert "more than max_reject_ratio 0.05" in e.value.message
    assert e.value.stats["verdict"] == "rejects" and e.value.stats["samples"] > 40
    # Refused: no dataset is left, only the reasons; the retry needs no overwrite.
    assert [p.name for p in (tmp_path / "ratio").iterdir()] == ["rejected.jsonl"]
    libdflash.build_dataset(inputs, tmp_path / "ratio", max_reject_ratio=1, **args)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("{not json\n[]\n")
    with pytest.raises(libdflash.FormatError, match="no sample written") as e:
        libdflash.build_dataset(junk, tmp_path / "junk", max_reject_ratio=1, **args)
    assert e.value.stats["verdict"] == "empty" and e.value.stats["rejected"] == 2
    with pytest.raises(FileNotFoundError, match="cannot read input .*nope.jsonl"):
        libdflash.build_dataset([inputs[0], tmp_path / "nope.jsonl"], tmp_path / "x", **args)
    with pytest.raises(FileNotFoundError):
        libdflash.build_dataset(inputs, tmp_path / "x", tokenizer=tmp_path / "no-tokenizer",
                                template="qwen3")
    with pytest.raises(libdflash.NotFoundError, match="unknown chat template") as e:
        libdflash.build_dataset(inputs, tmp_path / "x", tokenizer=TOK, template="nope")
    assert not isinstance(e.value, FileNotFoundError)
    with pytest.raises(libdflash.MismatchError, match="<think>"):
        libdflash.build_dataset(inputs, tmp_path / "x", tokenizer=TOK, template="qwen3")
    with pytest.raises(KeyError, match="keep_after_last_user"):
        libdflash.build_dataset(inputs, tmp_path / "x", reasoning="Drop", **args)
    with pytest.raises(libdflash.InvalidArgumentError, match="max_reject_ratio"):
        libdflash.build_dataset(inputs, tmp_path / "x", max_reject_ratio=2, **args)
    with pytest.raises(libdflash.InvalidArgumentError, match="no input"):
        libdflash.build_dataset([], tmp_path / "x", **args)
    assert not (tmp_path / "x").exists()


@needs_fixture
def test_build_dataset_progress_and_stop(tmp_path):
    inputs = write_inputs(tmp_path, n=60)
    args = dict(tokenizer=TOK, template="qwen3", allow_split_control_tokens=True,
                max_reject_ratio=1, batch_lines=10)
    seen = []
    stats = libdflash.build_dataset(inputs, tmp_path / "all", progress=seen.append, **args)
    assert seen[0]["lines"] == 0 and seen[-1] == stats
    assert [s["lines"] for s in seen] == sorted(s["lines"] for s in seen)
    assert len(seen) == 1 + -(-(stats["samples"] + stats["rejected"]) // 10)
    with pytest.raises(libdflash.CancelledError) as e:
        libdflash.build_dataset(inputs, tmp_path / "stop", progress=lambda s: s["lines"] > 0,
                                **args)
    assert 10 <= e.value.stats["lines"] < stats["lines"]
    assert not (tmp_path / "stop" / "dataset.json").exists()

    for exc in (KeyboardInterrupt, ZeroDivisionError):
        def fail(s, exc=exc):
            if s["lines"]:
                raise exc
        with pytest.raises(exc):  # stops the build, raised as it was
            libdflash.build_dataset(inputs, tmp_path / exc.__name__, progress=fail, **args)
        assert not (tmp_path / exc.__name__ / "dataset.json").exists()


def test_reasoning_names_from_the_library():
    from libdflash._lib import lib
    from libdflash.chat import REASONING, reasoning_mode
    assert REASONING == {"official": 0, "keep_all": 1, "keep_after_last_user": 2, "drop": 3}
    for name, value in REASONING.items():
        assert reasoning_mode(name) == value
        assert lib.dflash_chat_reasoning_name(value).decode() == name
    with pytest.raises(KeyError, match="known: official, keep_all"):
        reasoning_mode("official ")
    with pytest.raises(KeyError):
        libdflash.ChatTemplate("qwen3").render([{"role": "user", "content": "q"}],
                                               reasoning="nope")
