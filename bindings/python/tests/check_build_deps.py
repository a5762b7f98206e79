#!/usr/bin/env python3
"""An offline `pip install` on a machine without the -dev packages: meson's setup (which
pip runs through meson-python) names every missing system library with its Debian package,
instead of stopping at the first wrap download with "is the internet available?".

Simulated without touching the machine: pkg-config finds nothing (PKG_CONFIG_LIBDIR), CMake
is absent (a native file), and wrap downloads are off. Usage: check_build_deps.py SRC_ROOT.
Exit 77 (skipped) without meson."""
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    src = sys.argv[1]
    meson = shutil.which("meson")
    if not meson:
        print("meson not on PATH: skipped")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        native = os.path.join(tmp, "native.ini")
        with open(native, "w") as f:
            f.write("[binaries]\ncmake = '/nonexistent/cmake'\n")
        env = dict(os.environ, PKG_CONFIG_LIBDIR=os.path.join(tmp, "no-pkgconfig"))
        r = subprocess.run([meson, "setup", os.path.join(tmp, "b"), src, "--native-file", native,
                            "--wrap-mode=nodownload", "-Dpython_package=true", "-Dtests=disabled",
                            "-Dpython=disabled", "-Dcuda=disabled"],
                           capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    for package in ("libjansson-dev", "libpcre2-dev", "libcurl4-openssl-dev",
                    "libutf8proc-dev", "libopenblas-dev"):
        assert package in out, (package, out[-2000:])
    assert "missing build dependencies" in out and "apt-get install" in out, out[-2000:]
    print("missing -dev packages named:", [l for l in out.splitlines() if "missing build" in l])
    return 0


if __name__ == "__main__":
    sys.exit(main())
