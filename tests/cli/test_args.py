#!/usr/bin/env python3
"""One way to parse arguments across `dflash` subcommands: --help (exit 0) states the exit
status; an unknown option is named with the nearest valid one and a missing value or option is
named (exit 2); `--opt=value` means `--opt value`; bare `dflash` lists the pipeline's steps in
order. Needs DFLASH_CLI and the qwen2 tokenizer fixture for the encode round trip."""
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "chat"))
import hf_jinja  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
TOK = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
COMMANDS = ["inspect", "tokenize", "fetch", "show", "cp", "ls", "init-config", "train", "eval",
            "render", "encode", "decode"]
# (command, a misspelt option, the option it should suggest)
TYPOS = [("tokenize", "--tokenzier", "--tokenizer"), ("train", "--epoch", "--epochs"),
         ("eval", "--checkpont", "--checkpoint"), ("render", "--templat", "--template"),
         ("show", "--indx", "--index"), ("init-config", "--layer", "--layers"),
         ("encode", "--tokeniser", "--tokenizer"), ("cp", "--recursiv", "--recursive")]


def run(*args, stdin=""):
    return subprocess.run([CLI, *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=60)


def main():
    if not CLI:
        print("SKIP: needs DFLASH_CLI")
        sys.exit(77)
    for cmd in COMMANDS:
        r = run(cmd, "--help")
        assert r.returncode == 0 and "Exit status" in r.stdout, (cmd, r.stdout, r.stderr)
    for cmd, typo, near in TYPOS:
        r = run(cmd, typo, "x")
        assert r.returncode == 2, (cmd, r.stderr)
        assert f"unknown option {typo} (did you mean {near}?)" in r.stderr, (cmd, r.stderr)
    r = run("train", "--config")
    assert r.returncode == 2 and "--config needs a value" in r.stderr, r.stderr
    r = run("train", "--config", "c.json", "--target", "t", "--data", "d", "--hidden", "h")
    assert r.returncode == 2 and "missing -o" in r.stderr, r.stderr
    r = run("tokenize", "--truncate=yes")
    assert r.returncode == 2 and "--truncate takes no value" in r.stderr, r.stderr
    r = run("render", "--reasoning", "sometimes", "--template", "qwen3")
    assert r.returncode == 2 and "--reasoning does not take 'sometimes'" in r.stderr, r.stderr
    for cmd in ("tokenize", "render"):  # template names come from the library
        assert "kimi-k2.6" in run(cmd, "--help").stdout and "qwen3.6" in run(cmd, "--help").stdout
    if (TOK / "vocab.json").exists():
        a = run("encode", "--tokenizer", TOK, stdin="hello <|im_end|>")
        b = run("encode", f"--tokenizer={TOK}", "--special=all", stdin="hello <|im_end|>")
        assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and a.stdout, b.stderr
        c = run("encode", "--special", "none", "--tokenizer", TOK, stdin="hello <|im_end|>")
        assert c.returncode == 0 and c.stdout != a.stdout
    r = run()
    assert r.returncode == 2
    steps = [r.stderr.index(f"{i}. ") for i in range(1, 7)]
    assert steps == sorted(steps), r.stderr
    for i, cmd in enumerate(("dflash fetch", "dflash tokenize", "HiddenWriter",
                             "dflash init-config", "dflash train", "dflash eval"), 1):
        line = r.stderr[steps[i - 1]:].split("\n", 1)[0]
        assert cmd in line, (i, line)
    # The Python class by the package's name (`import dflash` is PyPI's other package).
    assert "libdflash.HiddenWriter" in r.stderr and " dflash.HiddenWriter" not in r.stderr
    print(f"arguments: {len(COMMANDS)} --help texts, {len(TYPOS)} suggestions, = form: OK")


if __name__ == "__main__":
    main()
