#!/usr/bin/env python3
"""Every public header compiles on its own, twice included, as strict C11 and as C++; no
stable header includes experimental.h (its calls are outside the stable ABI, a caller opts in);
train.h is the umbrella over drafter.h, trainer.h and run.h."""
import re
import pathlib
import subprocess
import sys
import tempfile

# argv: the include root, then the C compiler command (it may be a launcher such as ccache + gcc).
include_root, cc = pathlib.Path(sys.argv[1]), sys.argv[2:]
headers = sorted((include_root / "dflash").glob("*.h"))
failed = 0
with tempfile.TemporaryDirectory() as tmp:
    for header in headers:
        name = f"dflash/{header.name}"
        src = pathlib.Path(tmp) / "t.c"
        src.write_text(f"#include <{name}>\n#include <{name}>\nint main(void) {{ return 0; }}\n")
        for args in (["-std=c11", "-pedantic"], ["-std=c99", "-pedantic"]):
            cmd = [*cc, *args, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{include_root}", str(src)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                failed += 1
                print(f"FAIL {name} {' '.join(args)}\n{r.stderr}")
        cxx = pathlib.Path(tmp) / "t.cpp"
        cxx.write_text(src.read_text())
        r = subprocess.run(["c++", "-std=c++17", "-pedantic", "-Wall", "-Werror", "-fsyntax-only",
                            f"-I{include_root}", str(cxx)], capture_output=True, text=True)
        if r.returncode:
            failed += 1
            print(f"FAIL {name} as C++\n{r.stderr}")
for header in headers:
    included = set(re.findall(r"^#include <dflash/([a-z_]+\.h)>", header.read_text(), re.M))
    if header.name != "experimental.h" and "experimental.h" in included:
        failed += 1
        print(f"FAIL dflash/{header.name} includes experimental.h (outside the stable ABI)")
    if header.name == "train.h" and not {"drafter.h", "trainer.h", "run.h"} <= included:
        failed += 1
        print(f"FAIL dflash/train.h includes {sorted(included)}, not drafter.h, trainer.h, run.h")
# DFLASH_DEPRECATED warns a caller with its message, and DFLASH_NO_DEPRECATION_WARNINGS
# silences it (HACKING.md, "Deprecation").
with tempfile.TemporaryDirectory() as tmp:
    src = pathlib.Path(tmp) / "d.c"
    src.write_text("#include <dflash/dflash.h>\n"
                   "DFLASH_DEPRECATED(\"use g instead\") int f(void);\n"
                   "int main(void) { return f(); }\n")
    base = [*cc, "-std=c11", "-Wall", "-Werror", "-fsyntax-only", f"-I{include_root}", str(src)]
    r = subprocess.run(base, capture_output=True, text=True)
    if r.returncode == 0 or "use g instead" not in r.stderr:
        failed += 1
        print(f"FAIL DFLASH_DEPRECATED gave no warning with its message:\n{r.stderr}")
    r = subprocess.run([*base, "-DDFLASH_NO_DEPRECATION_WARNINGS"], capture_output=True, text=True)
    if r.returncode:
        failed += 1
        print(f"FAIL DFLASH_NO_DEPRECATION_WARNINGS did not silence it:\n{r.stderr}")
print(f"{len(headers)} headers checked, {failed} failures")
sys.exit(1 if failed or not headers else 0)
