#!/usr/bin/env python3
"""Compare the built library with the committed ABI baseline (abi/libdflash.abi).

The baseline holds every exported function and every type reachable from one. Any removed
or changed function or variable, and any change to a type a function uses (a field of an
options struct, a parameter), fails. A function added since the baseline passes only when it
sits in a symbol-version node the baseline does not have: a new release's node in
src/libdflash.map, which tests/abi/check_symbols.py checks against the headers.
After an intended change, regenerate the baseline with scripts/update-abi.sh and bump the
SONAME in meson.build if the change is incompatible.
Skips (77) when abigail-tools is missing, unless DFLASH_REQUIRE_ABI=1.

Usage: check_abi.py LIB BASELINE   (abi/suppressions beside BASELINE)
"""
import os
import re
import shutil
import subprocess
import sys

# abidiff's exit status bits (abidiff(1)): 1 error, 2 usage, 4 ABI change, 8 incompatible.
ABIDIFF_ERROR, ABIDIFF_USAGE, ABIDIFF_CHANGE, ABIDIFF_INCOMPATIBLE = 1, 2, 4, 8


def summary_counts(text):
    """(removed, changed, added) for functions and variables from abidiff's summary."""
    out = {}
    for kind in ("Functions", "Variables"):
        m = re.search(kind + r" changes summary: (\d+) Removed, (\d+) Changed[^,]*, (\d+) Added",
                      text)
        out[kind] = tuple(int(g) for g in m.groups()) if m else (0, 0, 0)
    return out


def added_symbols(text):
    """[(name, version)] of the functions and variables abidiff lists as added."""
    added, section = [], False
    for line in text.splitlines():
        if re.match(r"\d+ Added (function|variable)", line.strip()):
            section = True
            continue
        if section and line.strip() and not line.startswith(" "):
            section = False
        if section:
            for sym in re.findall(r"\{(\w+)@+([\w.]+)\}", line):
                added.append(sym)
            if "[A]" in line and "@" not in line:
                m = re.search(r"\b(dflash_\w+)\s*\(", line) or re.search(r"\b(dflash_\w+)'", line)
                if m:
                    added.append((m.group(1), ""))
    return added


def main():
    lib, baseline = sys.argv[1:3]
    if not shutil.which("abidiff"):
        print("abidiff not found (Debian package abigail-tools)")
        sys.exit(1 if os.environ.get("DFLASH_REQUIRE_ABI") == "1" else 77)
    if os.environ.get("DFLASH_SKIP_ABI") == "1":
        print("DFLASH_SKIP_ABI=1: baseline check skipped for this build (sanitizer or other compiler)")
        sys.exit(77)
    supp = os.path.join(os.path.dirname(baseline), "suppressions")  # experimental.h's calls
    r = subprocess.run(["abidiff", "--no-default-suppression", "--suppressions", supp, baseline, lib],
                       capture_output=True, text=True)
    print(r.stdout, r.stderr)
    if r.returncode & (ABIDIFF_ERROR | ABIDIFF_USAGE):
        print(f"abidiff failed (status {r.returncode})")
        sys.exit(1)
    counts = summary_counts(r.stdout)
    bad = []
    for kind, (removed, changed, _) in counts.items():
        if removed or changed:
            bad.append(f"{kind.lower()}: {removed} removed, {changed} changed")
    if r.returncode & ABIDIFF_INCOMPATIBLE:
        bad.append("abidiff reports an incompatible change")
    with open(baseline) as f:
        old_nodes = set(re.findall(r"version='([\w.]+)'", f.read()))
    for name, version in added_symbols(r.stdout):
        if not version or version in old_nodes:
            bad.append(f"{name}: added in node '{version or 'none'}', which the baseline already "
                       "has; new functions go in a new release's node of src/libdflash.map")
    if bad:
        print("ABI check failed against", baseline + ":", *bad, sep="\n  ")
        sys.exit(1)
    print("ABI unchanged against", baseline,
          "({} functions added in new nodes)".format(counts["Functions"][2]))


if __name__ == "__main__":
    main()
