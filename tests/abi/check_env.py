#!/usr/bin/env python3
"""Options only through options (HACKING.md, "The environment: hooks, not options"): fails on a
setenv, putenv, unsetenv or clearenv in src/, cuda/ or tools/, on a getenv there of a variable
that the HACKING table does not list, and on a getenv of a computed name that INDIRECT below
does not account for. A self-test of the scanner runs first, so the check cannot pass by
finding nothing.   check_env.py SOURCE_ROOT"""
import pathlib
import re
import sys

FOLDERS = ("src", "cuda", "tools")
SUFFIXES = {".c", ".h", ".cu", ".cuh", ".cpp", ".cc", ".hpp"}
HEADING = "## The environment: hooks, not options"

# getenv calls whose argument is not a string literal: (file, argument) -> the table's names
# that call can read. A new such call fails until it is added here and its names to the table.
INDIRECT = {
    ("src/train/cuda/dist.c", "name"): ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                   "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                                   "SLURM_LOCALID"],
    ("src/train/cuda/backend_cuda.c", "name"): ["NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE",
                                           "NCCL_MIN_NCHANNELS", "NCCL_ALGO", "NCCL_PROTO",
                                           "NCCL_GRAPH_FILE"],
    ("src/storage/storage.c", "env1"): ["AWS_ENDPOINT_URL_S3", "AWS_REGION",
                                        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                        "AWS_SESSION_TOKEN"],
    ("src/storage/storage.c", "env2"): ["AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"],
    ("src/fetch/loop.c", "o->api_key_env"): ["api_key_env"],
    ("src/storage/s3_profile.c", "name"): ["AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                                           "HOME", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"],
}

SETTERS = re.compile(r"\b(setenv|putenv|unsetenv|clearenv)\s*\(")
GETENV = re.compile(r"\b(?:secure_)?getenv\b")


def strip_comments(text):
    """The source with its comments blanked (newlines kept, so lines and offsets still count),
    twice: with its string and character literals (a literal is getenv's argument), and with
    them blanked too (a message may name getenv without calling it)."""
    out, masked, i, n = [], [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank = "".join(ch if ch == "\n" else " " for ch in text[i:j])
            out.append(blank), masked.append(blank)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1]), masked.append(c + " " * (len(text[i:j + 1]) - 1))
            i = j + 1
        else:
            out.append(c), masked.append(c)
            i += 1
    return "".join(out), "".join(masked)


def argument(code, pos):
    """The text between the parentheses of the call whose name ends at pos (None: no call,
    e.g. getenv passed as a function pointer)."""
    m = re.compile(r"\s*\(").match(code, pos)
    if not m:
        return None
    depth, j = 1, m.end()
    start = j
    while j < len(code) and depth:
        depth += {"(": 1, ")": -1}.get(code[j], 0)
        j += 1
    return code[start:j - 1].strip()


def scan(rel, text, listed):
    """The problems of one file: (line, message) pairs."""
    (code, masked), found = strip_comments(text), []
    line = lambda pos: code.count("\n", 0, pos) + 1
    for m in SETTERS.finditer(masked):
        found.append((line(m.start()), f"{m.group(1)}: the library and the command line take "
                      "settings through options, never by changing the environment"))
    for m in GETENV.finditer(masked):
        arg = argument(code, m.end())
        lit = re.fullmatch(r'"([^"\\]*)"', arg or "")
        if lit:
            if lit.group(1) not in listed:
                found.append((line(m.start()), f"getenv(\"{lit.group(1)}\"): not in HACKING.md's "
                              "table (a setting that changes behaviour or results is an option)"))
            continue
        names = INDIRECT.get((rel, arg))
        if names is None:
            found.append((line(m.start()), f"getenv({arg}): a computed name that check_env.py's "
                          "INDIRECT does not list"))
        else:
            for name in names:
                if name not in listed:
                    found.append((line(m.start()), f"{name} (read through getenv({arg})): not in "
                                  "HACKING.md's table"))
    return found


def table_names(hacking):
    text = hacking.read_text()
    if HEADING not in text:
        sys.exit(f"{hacking}: no section '{HEADING}'")
    section = text[text.index(HEADING):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    names = set()
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) > 2 and row.startswith("|") and not set(cells[1].strip()) <= set("-"):
            names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[1]))
    return names


def self_test():
    listed = {"DFLASH_OK_HOOK", "RANK"}
    cases = [('x = getenv("DFLASH_OK_HOOK");', 0), ('x = getenv("DFLASH_NEW_KNOB");', 1),
             ('/* getenv("DFLASH_NEW_KNOB") */ x = 1; // setenv("A", "1", 1)', 0),
             ('setenv("DFLASH_SPOOL_WAIT", w, 1);', 1), ("unsetenv(\"RANK\");", 1),
             ("putenv(s);", 1), ("x = getenv(name);", 1), ("f(getenv);", 1),
             ('x = secure_getenv ("DFLASH_NEW_KNOB");', 1), ('s = "getenv(\\"X\\")";', 0),
             ("c = '\\''; x = getenv(\"DFLASH_NEW_KNOB\");", 1)]
    for src, want in cases:
        got = len(scan("src/x.c", src, listed))
        assert got == want, f"self-test: {src!r}: {got} finding(s), expected {want}"
    assert scan("src/train/cuda/dist.c", "getenv(name)", listed), "INDIRECT names not in the table"


def main():
    root = pathlib.Path(sys.argv[1])
    self_test()
    listed = table_names(root / "HACKING.md")
    if not {"DFLASH_EMU_SEED", "OPENBLAS_CORETYPE"} <= listed:
        sys.exit(f"HACKING.md's table parsed to {sorted(listed)}: the parser lost rows")
    bad = 0
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            for ln, msg in scan(rel, path.read_text(errors="replace"), listed):
                print(f"{rel}:{ln}: {msg}")
                bad += 1
    print(f"{len(listed)} variables in HACKING.md's table; {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
