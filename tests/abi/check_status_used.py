#!/usr/bin/env python3
"""No caller inside the project drops a public function's dflash_status.

The internal functions that return a status carry DF_MUST_CHECK (src/core/internal.h), so the
compiler refuses a call that ignores one. The public ones cannot carry it without imposing it
on every user, so this check compiles the library's and the command line's C sources
(compile_commands.json of the build) with -fsyntax-only against a copy of include/dflash/ in
which every `DFLASH_API dflash_status` function is warn_unused_result, and fails on a dropped
status. A call whose failure really does not matter uses DF_IGNORE(call) (src/core/internal.h)
or checks it.

argv: the build directory, the source root.
"""
import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

build, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).resolve()
db = json.loads((build / "compile_commands.json").read_text())
units = []
for e in db:
    f = pathlib.Path(e["directory"], e["file"]).resolve()
    rel = f.relative_to(root) if f.is_relative_to(root) else None
    if rel and rel.suffix == ".c" and rel.parts[0] in ("src", "tools"):
        units.append((e, rel))
if not units:
    print(f"no src/ or tools/ C sources in {build}/compile_commands.json")
    sys.exit(1)


def command(e, inc):
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MQ", "-MF", "-MT"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD"):
            continue
        out.append(a)
    first_opt = next(i for i, a in enumerate(out) if a.startswith("-"))
    return out[:first_opt] + [f"-I{inc}"] + out[first_opt:] + ["-fsyntax-only",
                                                                 "-Werror=unused-result",
                                                                 "-fdiagnostics-color=never"]


with tempfile.TemporaryDirectory() as tmp:
    inc = pathlib.Path(tmp)
    (inc / "dflash").mkdir()
    marked = 0
    for h in sorted((root / "include" / "dflash").glob("*.h")):
        text, n = re.subn(r"^DFLASH_API dflash_status\b",
                          "DFLASH_API __attribute__((warn_unused_result)) dflash_status",
                          h.read_text(), flags=re.M)
        marked += n
        (inc / "dflash" / h.name).write_text(text)

    def run(unit):
        e, rel = unit
        r = subprocess.run(command(e, inc), cwd=e["directory"], capture_output=True, text=True)
        return rel, r.returncode, r.stderr

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for rel, rc, err in pool.map(run, units):
            if rc:
                failed += 1
                print(f"FAIL {rel}\n{err}")
print(f"{len(units)} sources checked against {marked} status-returning public functions, "
      f"{failed} failures")
sys.exit(1 if failed else 0)
