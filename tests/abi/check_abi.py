#!/usr/bin/env python3
"""Compare the built library with the committed ABI baseline (abi/libdflash.abi).

Added functions are fine; any change to an existing function or type fails.
After an intended change, regenerate the baseline with scripts/update-abi.sh
and bump the SONAME in meson.build if the change is incompatible.
Skips (77) when abigail-tools is missing, unless DFLASH_REQUIRE_ABI=1.
"""
import os
import shutil
import subprocess
import sys

lib, baseline, headers = sys.argv[1:4]
if not shutil.which("abidiff"):
    print("abidiff not found (Debian package abigail-tools)")
    sys.exit(1 if os.environ.get("DFLASH_REQUIRE_ABI") == "1" else 77)
if os.environ.get("DFLASH_SKIP_ABI") == "1":
    print("DFLASH_SKIP_ABI=1: baseline check skipped for this build (sanitizer or other compiler)")
    sys.exit(77)
cmd = ["abidiff", "--no-added-syms", "--headers-dir2", headers, baseline, lib]
r = subprocess.run(cmd, capture_output=True, text=True)
print(r.stdout, r.stderr)
sys.exit(1 if r.returncode else 0)
