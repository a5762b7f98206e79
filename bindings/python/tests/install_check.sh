#!/usr/bin/env bash
# `pip install bindings/python` against an INSTALLED libdflash, then the pytest
# suite from outside the source tree with the installed package and library.
#   install_check.sh BUILD_DIR SOURCE_ROOT
# The built library is installed (`meson install --destdir`) into a temporary
# root and relocated there (its pkg-config file's prefix rewritten), as if
# configured with --prefix=THAT. The package is installed into a fresh venv
# (system site packages for numpy/pytest) with --no-build-isolation --no-deps
# --no-index: no network. Checked: the library is found through its soname on
# LD_LIBRARY_PATH, and through `pkg-config dflash` with nothing else set.
# Exit 77 (skip) when venv, pip, setuptools or (setuptools < 70.1) wheel are missing.
# DFLASH_INSTALL_CHECK_PYTEST: extra pytest arguments (e.g. -k to narrow the suite).
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
py=${PYTHON:-python3}

skip() { echo "SKIP: $*"; exit 77; }
"$py" -c 'import venv, ensurepip' 2>/dev/null || skip "python3 lacks venv/ensurepip"
"$py" - <<'PY' || skip "no setuptools>=61 with wheel support (pip install -r scripts/requirements.txt)"
import importlib.util, setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
assert v >= (61, 0)
assert v >= (70, 1) or importlib.util.find_spec("wheel")  # bdist_wheel before setuptools 70.1
PY

tmp=$(mktemp -d "${TMPDIR:-/tmp}/dflash-install-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# 1. The library, installed and relocated to $prefix.
meson install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >/dev/null
orig_prefix=$(meson introspect "$build" --buildoptions |
  "$py" -c 'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
prefix="$tmp/root$orig_prefix"
lib=$(find "$prefix" -name "libdflash.so.[0-9]" | head -n1)
[ -n "$lib" ] || { echo "FAIL: no libdflash.so.N under $prefix"; exit 1; }
libdir=$(dirname "$lib")
pcdir="$libdir/pkgconfig"
sed -i "s|^prefix=.*|prefix=$prefix|" "$pcdir/dflash.pc"
echo "installed: $lib"

# 2. The package, from a copy of its sources (a pip build leaves build/ and
#    *.egg-info behind in the folder it builds).
cp -r "$src/bindings/python" "$tmp/pkg"
rm -rf "$tmp/pkg/tests"
"$py" -m venv --system-site-packages "$tmp/venv" || skip "cannot create a venv"
vpy="$tmp/venv/bin/python"
"$vpy" -m pip --version >/dev/null 2>&1 || skip "no pip in the venv"
"$vpy" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --no-index \
  "$tmp/pkg"
"$vpy" -m pip show libdflash | grep -E '^(Name|Version|Location)'

# 3. Run from outside the source tree, with nothing pointing into it.
cd "$tmp"
unset DFLASH_LIBRARY PYTHONPATH LD_LIBRARY_PATH  # meson test points LD_LIBRARY_PATH at the build
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
check='import libdflash, sys
from libdflash import _lib
assert libdflash.__file__.startswith(sys.argv[1]), libdflash.__file__
assert libdflash.version() == libdflash.__version__, (libdflash.version(), libdflash.__version__)
mapped = {l.split()[-1] for l in open("/proc/self/maps") if "libdflash.so" in l}
assert len(mapped) == 1 and min(mapped).startswith(sys.argv[2]), mapped
print(f"libdflash {libdflash.__version__} from {libdflash.__file__}, library {_lib.lib._name}")'
# 3a. found through the soname on LD_LIBRARY_PATH
LD_LIBRARY_PATH="$libdir" "$vpy" -c "$check" "$site" "$libdir/"
# 3b. found through pkg-config alone
PKG_CONFIG_PATH="$pcdir" "$vpy" -c "$check" "$site" "$libdir/"
# 3c. the pytest suite against the installed package, library, CLI and headers
cli=$(find "$prefix" -path '*/bin/dflash' | head -n1)
# shellcheck disable=SC2086
LD_LIBRARY_PATH="$libdir" DFLASH_CLI="$cli" DFLASH_INCLUDE_DIR="$prefix/include" \
  DFLASH_EXPECT_PACKAGE_DIR="$site" \
  "$vpy" -m pytest -q -p no:cacheprovider "$src/bindings/python/tests" \
  ${DFLASH_INSTALL_CHECK_PYTEST:-}
