#!/usr/bin/env python3
"""README.md runs as written: every fenced shell block of it, and its links resolve.

The convention (README.md states it under "Testing"):
- A fenced block tagged `sh`, `bash`, `shell` or `console` is a shell block. This test runs
  each one, whole, under `bash -euo pipefail`, unless the line just above its opening fence
  (blank lines between are allowed) is an HTML comment `<!-- not run: REASON -->`, which
  names why a test cannot run it: it needs the network, a GPU, root, or it is the
  15-minute main job. A marker with no reason fails the test, as does a marker above
  anything but a shell block.
- Blocks run in a fresh temporary folder that holds a symbolic link to every top-level entry
  of the repository (so `examples/...` and `scripts/...` resolve as from a clone) and
  receives whatever the commands write; `dflash` on PATH is the build's CLI ($DFLASH_CLI, or
  build-dev/tools/dflash/dflash), and Python finds the package in bindings/python with
  $DFLASH_LIBRARY when set.
- Also checked: README.md has at most 200 lines, and every relative link `[text](path)` in
  README.md and docs/*.md names a file or folder that exists.

Run by meson (suite `docs`); by hand: DFLASH_CLI=build-dev/tools/dflash/dflash python3
tests/docs/readme_commands.py (from the repository root, not from a build folder).
"""
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHELL_TAGS = {"sh", "bash", "shell", "console"}
MARKER = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
MAX_LINES = 200
BLOCK_TIMEOUT_S = 60


def blocks(text):
    """(line number, tag, body, marker reason or None, marker line or None) per fenced block."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(```+)\s*([A-Za-z0-9_+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, tag, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        if j == len(lines):
            sys.exit(f"README.md:{start + 1}: fenced block never closed")
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k].strip()) if k >= 0 else None
        out.append((start + 1, tag, "\n".join(lines[start + 1:j]),
                    mk.group(1) if mk else None, k + 1 if mk else None))
        i = j + 1
    return out


def check_links(problems):
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    for f in files:
        text = f.read_text()
        # fenced code is not prose: links inside it are not links
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (f.parent / path).exists():
                problems.append(f"{f.relative_to(ROOT)}: link to {target}: no such file")


def find_cli():
    cli = os.environ.get("DFLASH_CLI") or str(ROOT / "build-dev" / "tools" / "dflash" / "dflash")
    if not os.access(cli, os.X_OK):
        sys.exit(f"no dflash CLI at {cli} (set DFLASH_CLI)")
    return os.path.abspath(cli)


def main():
    problems = []
    readme = (ROOT / "README.md").read_text()
    n_lines = readme.count("\n") + (0 if readme.endswith("\n") else 1)
    if n_lines > MAX_LINES:
        problems.append(f"README.md: {n_lines} lines, more than {MAX_LINES}")
    check_links(problems)

    lines = readme.split("\n")
    for i, ln in enumerate(lines):
        if ln.strip().startswith("<!--") and "not run" in ln and not MARKER.match(ln.strip()):
            problems.append(f"README.md:{i + 1}: malformed marker {ln.strip()!r}")

    found = blocks(readme)
    to_run = []
    for line, tag, body, reason, mline in found:
        if reason is not None and tag not in SHELL_TAGS:
            problems.append(f"README.md:{mline}: 'not run' marker above a {tag or 'plain'} block")
        elif reason == "":
            problems.append(f"README.md:{mline}: 'not run' marker without a reason")
        elif tag in SHELL_TAGS and reason is None:
            to_run.append((line, body))
    if not to_run:
        problems.append("README.md: no shell block runs (every one is marked 'not run')")

    cli = find_cli()
    with tempfile.TemporaryDirectory(prefix="dflash-readme-") as tmp:
        tmp = pathlib.Path(tmp)
        work, bindir = tmp / "work", tmp / "bin"
        work.mkdir()
        bindir.mkdir()
        (bindir / "dflash").symlink_to(cli)
        for entry in ROOT.iterdir():
            if entry.name not in (".git",) and not entry.name.startswith("build"):
                (work / entry.name).symlink_to(entry)
        env = dict(os.environ)
        env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "bindings" / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
        env["HOME"] = str(tmp)  # nothing a block writes lands in the real home
        for line, body in to_run:
            try:
                r = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=work, env=env,
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                   timeout=BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"README.md:{line}: block ran past {BLOCK_TIMEOUT_S} s")
                continue
            if r.returncode != 0:
                problems.append(f"README.md:{line}: block exited {r.returncode}\n--- block\n{body}"
                                f"\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-2000:]}")
            else:
                print(f"README.md:{line}: ran ({len(body.splitlines())} lines)")
    skipped = [(line, reason) for line, tag, _, reason, _ in found if reason]
    for line, reason in skipped:
        print(f"README.md:{line}: not run: {reason}")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"ok: {len(to_run)} shell blocks ran, {len(skipped)} marked not run, {n_lines} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
