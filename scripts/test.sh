#!/usr/bin/env bash
# Installs dependencies, then checks the format (scripts/check-format.sh, clang-format 14),
# builds and runs every test. Warnings are errors here
# (-Dwerror=true), never in a user's build (meson.build leaves werror off).
#   1. gcc: all suites (unit, ABI/symbols/headers, fuzz corpus, Python, reference oracles)
#   2. clang: unit suites
#   3. gcc and clang, --buildtype=release (-O3): unit suites, so an -O3-only warning shows here
#   4. gcc with ASan + UBSan: unit suites and fuzz corpus
#   5. clang with TSan: the suites that run threads (thread pool, batch tokenizer, dataset
#      build and dflash tokenize, the fetcher's loop and writer, hidden-store prefetch,
#      host communicator, the emulated CUDA device's fibers and NCCL ranks)
#   The emulated CUDA device (suite cuda-emu) runs in every build without nvcc's backend.
#   6. valgrind over the core unit suite
# Usage: scripts/test.sh [--no-deps]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--no-deps" ] || scripts/deps.sh
export PATH="$PATH:/usr/local/cuda/bin"

echo "== format =="
scripts/check-format.sh

setup() { # setup DIR [meson args...]: configure a fresh or existing build folder
  local dir=$1; shift
  local log; log=$(mktemp)
  local re=(); [ -f "$dir/build.ninja" ] && re=(--reconfigure)
  # Quiet when it works; meson's own account when it does not.
  meson setup "${re[@]}" "$dir" -Dwerror=true "$@" >"$log" 2>&1 || { cat "$log"; rm -f "$log"; return 1; }
  rm -f "$log"
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
CC=clang CXX=clang++ setup build-clang -Dtests=enabled -Dpython=disabled -Dcuda=disabled
ninja -C build-clang
DFLASH_SKIP_ABI=1 run_tests build-clang --no-suite abi

# CUDA once: nvcc compiles .cu files with its own host compiler whatever CC is. The emulated
# device (suite cuda-emu) is built where nvcc's backend is not, with CC and CXX of one kind.
for cc in gcc clang; do
  echo "== $cc release =="
  cuda=auto; cxx=g++; [ "$cc" = gcc ] || { cuda=disabled; cxx=clang++; }
  CC=$cc CXX=$cxx setup "build-$cc-release" --buildtype=release -Dtests=enabled \
    -Dpython=disabled -Dcuda=$cuda
  ninja -C "build-$cc-release"
  run_tests "build-$cc-release" --suite unit --suite fuzz --suite cuda-emu
done

echo "== ASan + UBSan =="
setup build-asan -Dtests=enabled -Dpython=disabled -Dcuda=disabled \
  -Db_sanitize=address,undefined -Db_lundef=false
ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  DFLASH_SKIP_ABI=1 run_tests build-asan --no-suite abi --no-suite oracle  # Python oracles load the lib into an uninstrumented interpreter

echo "== TSan =="
# Only the binaries are instrumented; the Python drivers of the CLI tests run uninstrumented.
CC=clang CXX=clang++ setup build-tsan -Dtests=enabled -Dpython=disabled -Dcuda=disabled \
  -Db_sanitize=thread -Db_lundef=false
ninja -C build-tsan
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/cuda/emu/tsan.supp \
  OPENBLAS_NUM_THREADS=1 \
  run_tests build-tsan core tokenizer dataset chat-tokenize-cli fetch fetch-e2e hidden train storage storage-s3 \
    cuda-emu-selftest cuda-emu-model

echo "== valgrind =="
run_tests build-gcc --setup=valgrind --suite core

echo "all tests passed"
