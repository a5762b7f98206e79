#!/usr/bin/env python3
"""The library exports exactly the functions declared DFLASH_API in the public headers."""
import pathlib
import re
import subprocess
import sys

lib, include_dir = sys.argv[1], pathlib.Path(sys.argv[2])

declared = set()
for header in sorted(include_dir.glob("*.h")):
    text = header.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # comments mention names too
    for m in re.finditer(r"\bDFLASH_API\b([^;{]*)", text):
        decl = m.group(1)
        # `T (dflash_x)(...)`: a name kept beside a function-like macro of the same name.
        f = re.search(r"\((dflash_\w+)\)\s*\(", decl) or re.search(r"\b(dflash_\w+)\s*\(", decl)
        if f:
            declared.add(f.group(1))

nm = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True, text=True)
exported = set()
for line in nm.stdout.splitlines():
    parts = line.split()
    if len(parts) == 3 and parts[1] in "TDBRWVtdbr" and parts[1] != "A":
        exported.add(parts[2].split("@")[0])

missing = sorted(declared - exported)
extra = sorted(exported - declared)
if missing:
    print("declared DFLASH_API but not exported:", *missing, sep="\n  ")
if extra:
    print("exported but not declared DFLASH_API:", *extra, sep="\n  ")
print(f"{len(declared)} declared, {len(exported)} exported")
sys.exit(1 if missing or extra else 0)
