#!/usr/bin/env bash
# Installs dependencies, then builds and runs every test:
#   1. gcc, -Werror: all suites (unit, ABI/symbols/headers, fuzz corpus, Python, reference oracles)
#   2. clang, -Werror: unit suites
#   3. gcc with ASan + UBSan: unit suites and fuzz corpus
#   4. valgrind over the core unit suite
# Usage: scripts/test.sh [--no-deps]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--no-deps" ] || scripts/deps.sh
export PATH="$PATH:/usr/local/cuda/bin"

setup() { # setup DIR [meson args...]: configure a fresh or existing build folder
  local dir=$1; shift
  if [ -f "$dir/build.ninja" ]; then meson setup --reconfigure "$dir" "$@" >/dev/null
  else meson setup "$dir" "$@" >/dev/null; fi
}
run_tests() { # run_tests DIR [meson test args...]
  local dir=$1; shift
  meson test -C "$dir" --print-errorlogs --num-processes "$(nproc)" "$@"
}

echo "== gcc =="
setup build-gcc -Dtests=enabled -Dpython=enabled
ninja -C build-gcc
DFLASH_REQUIRE_ABI=1 run_tests build-gcc

echo "== clang =="
CC=clang setup build-clang -Dtests=enabled -Dpython=disabled -Dcuda=disabled
ninja -C build-clang
DFLASH_SKIP_ABI=1 run_tests build-clang --no-suite abi

echo "== ASan + UBSan =="
setup build-asan -Dtests=enabled -Dpython=disabled -Dcuda=disabled \
  -Db_sanitize=address,undefined -Db_lundef=false
ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  DFLASH_SKIP_ABI=1 run_tests build-asan --no-suite abi --no-suite oracle  # Python oracles load the lib into an uninstrumented interpreter

echo "== valgrind =="
run_tests build-gcc --setup=valgrind --suite core

echo "all tests passed"
