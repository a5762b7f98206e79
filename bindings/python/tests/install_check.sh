#!/usr/bin/env bash
# `pip install` of the repository, as a Python user gets it, then the binding suite from
# outside the source tree:
#   install_check.sh BUILD_DIR SOURCE_ROOT
# 1. The sdist (meson-python's build_sdist: `meson dist` of the COMMITTED tree, so
#    uncommitted changes are not in it) and a wheel built from that sdist by pip
#    (-Dcuda=disabled: the CPU package), offline: --no-build-isolation --no-deps --no-index
#    with the meson-python of scripts/requirements.txt and Debian's meson and ninja.
# 2. The wheel installed into a fresh venv (system site packages for numpy and pytest):
#    `import libdflash` loads the library inside the package even with DFLASH_LIBRARY set
#    elsewhere, `dflash --version` and `dflash --help` run from the venv's bin/, and the
#    pytest suite passes against that package, library and CLI.
# 3. The system library for C users: BUILD_DIR's `meson install` (into a temporary root,
#    relocated there) is found, once the package's own library is removed, through its
#    soname on LD_LIBRARY_PATH and through `pkg-config dflash` with nothing else set; and
#    test_cuda_module.py runs against that layout (libdflash-cuda.so beside the library).
# Exit 77 (skip) when venv, pip, meson-python or git (for the sdist) is missing, or
# SOURCE_ROOT is not a git checkout.
# DFLASH_INSTALL_CHECK_PYTEST: extra pytest arguments (e.g. -k to narrow the suite).
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
py=${PYTHON:-python3}

skip() { echo "SKIP: $*"; exit 77; }
"$py" -c 'import venv, ensurepip' 2>/dev/null || skip "python3 lacks venv/ensurepip"
"$py" -c 'import mesonpy' 2>/dev/null ||
  skip "no meson-python (pip install -r scripts/requirements.txt, its no-deps lines too)"
command -v git >/dev/null || skip "no git (meson dist makes the sdist from the git tree)"
git -C "$src" rev-parse --git-dir >/dev/null 2>&1 || skip "$src is not a git checkout"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/dflash-install-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Nothing from meson test's environment may point into the source or build tree.
unset DFLASH_LIBRARY DFLASH_CUDA_MODULE DFLASH_PYEXT PYTHONPATH LD_LIBRARY_PATH

# 1. sdist, then the wheel from it (one build of the library).
if [ -n "$(git -C "$src" status --porcelain --untracked-files=no)" ]; then
  echo "NOTE: $src has uncommitted changes; the sdist holds the committed tree only"
fi
mkdir "$tmp/dist"
(cd "$src" && "$py" -c 'import mesonpy, sys
print(mesonpy.build_sdist(sys.argv[1], {"setup-args": ["-Dcuda=disabled"]}))' "$tmp/dist") \
  >"$tmp/sdist.log" 2>&1 || { cat "$tmp/sdist.log"; echo "FAIL: build_sdist"; exit 1; }
sdist=$(find "$tmp/dist" -name 'libdflash-*.tar.gz')
[ -n "$sdist" ] || { cat "$tmp/sdist.log"; echo "FAIL: no sdist in $tmp/dist"; exit 1; }
echo "sdist: $(basename "$sdist")"
"$py" -m venv --system-site-packages "$tmp/venv" || skip "cannot create a venv"
vpy="$tmp/venv/bin/python"
"$vpy" -m pip --version >/dev/null 2>&1 || skip "no pip in the venv"
pipq=(-m pip -q --disable-pip-version-check)
"$vpy" "${pipq[@]}" wheel --no-build-isolation --no-deps --no-index -w "$tmp/dist" \
  -Csetup-args=-Dcuda=disabled "$sdist" >"$tmp/wheel.log" 2>&1 ||
  { cat "$tmp/wheel.log"; echo "FAIL: pip wheel of the sdist"; exit 1; }
wheel=$(find "$tmp/dist" -name 'libdflash-*.whl')
echo "wheel: $(basename "$wheel")"
# What the wheel holds besides the package's .py files: the library, the CLI, the script,
# the compiled encode (libdflash._fast, when this Python has its headers); no headers,
# pkg-config file or CUDA module (this is the CPU build).
"$vpy" - "$wheel" <<'PY'
import os, sys, sysconfig, zipfile
version = os.path.basename(sys.argv[1]).split("-")[1]
names = zipfile.ZipFile(sys.argv[1]).namelist()
native = sorted(n for n in names if not n.endswith(".py") and ".dist-info/" not in n)
ext = ["libdflash/_fast" + sysconfig.get_config_var("EXT_SUFFIX")]
if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    ext = []
assert native == sorted([f"libdflash-{version}.data/scripts/dflash", "libdflash/bin/dflash",
                         "libdflash/lib/libdflash.so.1", *ext]), native
assert "libdflash/_lib.py" in names and "libdflash/__init__.py" in names, names
PY

# 2. The wheel in a fresh venv, used from outside the tree.
"$vpy" "${pipq[@]}" install --no-deps --no-index "$wheel"
"$vpy" -m pip show libdflash | grep -E '^(Name|Version|Location)'
cd "$tmp"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
check='import libdflash, sys
from libdflash import _lib
assert libdflash.__file__.startswith(sys.argv[1]), libdflash.__file__
assert libdflash.version() == libdflash.__version__, (libdflash.version(), libdflash.__version__)
print(libdflash.Tokenizer)
import glob
from libdflash import tokenizer
if glob.glob(sys.argv[1] + "/libdflash/_fast.*"):  # the package has its extension: it loads
    assert tokenizer._fast and tokenizer._fast.__file__.startswith(sys.argv[1]), tokenizer._fast
mapped = {l.split()[-1] for l in open("/proc/self/maps") if "libdflash.so" in l}
assert mapped == {sys.argv[2]}, mapped
print(f"libdflash {libdflash.__version__} from {libdflash.__file__}, library {_lib.lib._name}")'
bundled="$site/libdflash/lib/libdflash.so.1"
# 2a. the bundled library, also when DFLASH_LIBRARY names the build folder's
"$vpy" -c "$check" "$site" "$bundled"
DFLASH_LIBRARY="$build/libdflash.so" "$vpy" -c "$check" "$site" "$bundled"
# 2b. the command on the venv's PATH
PATH="$tmp/venv/bin:$PATH" dflash --version | tee "$tmp/version.txt"
grep -q "^dflash $("$vpy" -c 'import libdflash; print(libdflash.__version__)') " "$tmp/version.txt"
PATH="$tmp/venv/bin:$PATH" dflash --help >/dev/null
# 2c. the pytest suite against the installed package, its library and CLI (headers from
#     the source tree: the wheel has none)
# shellcheck disable=SC2086
DFLASH_CLI="$tmp/venv/bin/dflash" DFLASH_INCLUDE_DIR="$src/include" \
  DFLASH_EXPECT_PACKAGE_DIR="$site" \
  "$vpy" -m pytest -q -p no:cacheprovider "$src/bindings/python/tests" \
  ${DFLASH_INSTALL_CHECK_PYTEST:-}

# 3. The system's library (meson install of BUILD_DIR, relocated to $prefix), once the
#    package's own is gone.
meson install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >/dev/null
orig_prefix=$(meson introspect "$build" --buildoptions |
  "$py" -c 'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
prefix="$tmp/root$orig_prefix"
lib=$(find "$prefix" -name "libdflash.so.[0-9]" | head -n1)
[ -n "$lib" ] || { echo "FAIL: no libdflash.so.N under $prefix"; exit 1; }
libdir=$(dirname "$lib")
pcdir="$libdir/pkgconfig"
sed -i "s|^prefix=.*|prefix=$prefix|" "$pcdir/dflash.pc"
rm "$bundled"
LD_LIBRARY_PATH="$libdir" "$vpy" -c "$check" "$site" "$(readlink -f "$lib")"
PKG_CONFIG_PATH="$pcdir" "$vpy" -c "$check" "$site" "$(readlink -f "$lib")"
# The CUDA module as `meson install` lays it out (beside the library in the libdir, when
# BUILD_DIR has CUDA): the wheel above is the CPU one.
LD_LIBRARY_PATH="$libdir" "$vpy" -m pytest -q -p no:cacheprovider \
  "$src/bindings/python/tests/test_cuda_module.py"
echo "install check passed"
