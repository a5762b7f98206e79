#!/usr/bin/env bash
# The test run, in three tiers (HACKING.md, "Which tests to run when", says what each costs):
#   --quick  one build folder (build-dev, or $DFLASH_BUILD_DIR; gcc, the emulated CUDA device):
#            the format check, suites unit, abi and fuzz (committed corpora), and the emulated
#            CUDA device's smoke tests (its self-test, the attention kernels, a training run
#            against the CPU's). Minutes.
#   --dev    the same build folder: every suite but the llama.cpp pipeline (oracles, Python,
#            the command line, fetch end-to-end, S3 against moto, examples, the fault-injection
#            loop, the emulated device whole).
#   (none)   the full run CI makes (.ci/run): scripts/deps.sh first (--no-deps skips it), the
#            format check, then warnings as errors (-Dwerror=true, never in a user's build):
#   1. gcc: all suites (unit, ABI/symbols/headers, fuzz corpus, Python, reference oracles (the
#      tokenizer's on a quarter of their corpus), the fault-injection loop, the llama.cpp
#      pipeline: the only build that runs it); gcc builds the nvcc backend where nvcc is
#      installed, so no emulated device here; then the unit suites again under OpenBLAS's
#      generic Prescott kernels (another GEMM summation order than the CPU's own)
#   2. clang: every suite but abi, python, oracle (the references against PyTorch, jinja2 and
#      SpecForge: gcc's build runs them; the unit suites check the same paths here) and bench
#      (fetch-adaptive, gpu-model: gcc's), and the emulated CUDA device whole: the one build
#      that runs its parity and bench/gpu_check.sh at full shapes (suite cuda-emu-heavy, at
#      sm_90 and sm_120)
#   3. gcc and clang, --buildtype=release (-O3): unit suites and fuzz corpus, so an -O3-only
#      warning or optimiser-dependent bug in the library shows here; only what those tests
#      need is built (not the emulated device, not the nvcc module: builds 1 and 2 have them)
#   4. gcc with ASan + UBSan: every suite but abi, the oracles, bench and cuda-emu-heavy (the
#      emulated device's other tests run its kernels at smaller shapes; the fault loop with
#      LeakSanitizer after every injected failure)
#   5. clang with TSan: the suites that run threads (thread pool, batch tokenizer, dataset
#      build and dflash tokenize, the fetcher's loop and writer, hidden-store prefetch,
#      host communicator, the emulated CUDA device's fibers and NCCL ranks)
#   6. valgrind over the core unit suite
# HACKING.md ("Which tests to run when") has the times of each tier and stage.
# Usage: scripts/test.sh [--quick | --dev] [--no-deps]
set -euo pipefail
cd "$(dirname "$0")/.."
tier=full deps=1
for arg in "$@"; do
  case "$arg" in
    --quick) tier=quick ;;
    --dev) tier=dev ;;
    --no-deps) deps=0 ;;
    *) echo "usage: scripts/test.sh [--quick | --dev] [--no-deps]" >&2; exit 2 ;;
  esac
done
# The quick and dev tiers are for a working tree whose dependencies are installed.
[ "$tier" != full ] || [ "$deps" = 0 ] || { scripts/deps.sh; echo "-- scripts/deps.sh took $SECONDS s"; }
export PATH="$PATH:/usr/local/cuda/bin"

# Each stage's header says how long the one before took, so a CI log shows where its minutes go.
stage_start=$SECONDS
stage() {
  [ "$stage_start" = "$SECONDS" ] || echo "-- took $((SECONDS - stage_start)) s ($SECONDS s in all)"
  stage_start=$SECONDS
  echo "== $* =="
}
stage "format, include layering"
scripts/check-format.sh
scripts/include-graph.sh --check

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

if [ "$tier" != full ]; then
  dir=${DFLASH_BUILD_DIR:-build-dev}
  stage "$tier: $dir"
  setup "$dir" -Dtests=enabled -Dpython=enabled -Dcuda=disabled
  ninja -C "$dir"
  if [ "$tier" = quick ]; then
    run_tests "$dir" --no-rebuild --suite unit --suite abi --suite fuzz
    OPENBLAS_NUM_THREADS=1 run_tests "$dir" --no-rebuild cuda-emu-selftest cuda-emu-attention \
      cuda-emu-run
  else
    OPENBLAS_NUM_THREADS=1 run_tests "$dir" --no-rebuild --no-suite pipeline
  fi
  echo "$tier tests passed"
  exit 0
fi

stage "gcc"
setup build-gcc -Dtests=enabled -Dpython=enabled
ninja -C build-gcc
# The tokenizer oracles on 5 MB of generated text (a quarter of their default 20 MB, which
# --dev and a run by hand keep), from the same 13 generators and seeds; oracle_tiktoken was the slowest oracle (383 s in a loaded build-dev at 20 MB).
DFLASH_CORPUS_MB=5 DFLASH_REQUIRE_ABI=1 run_tests build-gcc

# The unit suites again under OpenBLAS's generic Prescott kernels, which sum GEMMs in another
# order than the kernels this CPU gets by default (Haswell, Zen, SkylakeX): a test that
# depends on a GEMM's last bits fails here before a user with another CPU meets it (Debian's
# OpenBLAS 0.3.21 itself falls back to Prescott on CPUs it does not know, AVX-512 ones
# included). One extra run, about 2 min; by hand, OPENBLAS_CORETYPE=Haswell likewise.
stage "gcc: unit suites with OPENBLAS_CORETYPE=Prescott"
OPENBLAS_CORETYPE=Prescott OPENBLAS_NUM_THREADS=1 run_tests build-gcc --no-rebuild --suite unit

stage "clang"
CC=clang CXX=clang++ setup build-clang -Dtests=enabled -Dpython=disabled -Dcuda=disabled
ninja -C build-clang
DFLASH_SKIP_ABI=1 run_tests build-clang --no-suite abi --no-suite bench --no-suite oracle

# CUDA once: nvcc compiles .cu files with its own host compiler whatever CC is. The emulated
# device (suite cuda-emu) is built where nvcc's backend is not, with CC and CXX of one kind.
for cc in gcc clang; do
  stage "$cc release"
  cuda=auto; cxx=g++; [ "$cc" = gcc ] || { cuda=disabled; cxx=clang++; }
  CC=$cc CXX=$cxx setup "build-$cc-release" --buildtype=release -Dtests=enabled \
    -Dpython=disabled -Dcuda=$cuda
  # No whole-tree ninja: meson test builds what the selected tests need (the library, the
  # unit and fuzz programs, the CLI), not the emulated device or the nvcc module, which the
  # clang and gcc builds compile already with warnings as errors (minutes at -O3).
  run_tests "build-$cc-release" --suite unit --suite fuzz
done

stage "ASan + UBSan"
setup build-asan -Dtests=enabled -Dpython=disabled -Dcuda=disabled \
  -Db_sanitize=address,undefined -Db_lundef=false
ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  DFLASH_SKIP_ABI=1 run_tests build-asan --no-suite abi --no-suite oracle \
  --no-suite bench --no-suite cuda-emu-heavy  # oracles: an uninstrumented interpreter

stage "TSan"
# Only the binaries are instrumented; the Python drivers of the CLI tests run uninstrumented.
CC=clang CXX=clang++ setup build-tsan -Dtests=enabled -Dpython=disabled -Dcuda=disabled \
  -Db_sanitize=thread -Db_lundef=false
# meson test builds only what the listed tests need (no whole-tree ninja, as for -O3).
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/cuda/emu/tsan.supp \
  OPENBLAS_NUM_THREADS=1 \
  run_tests build-tsan core tokenizer dataset chat-tokenize-cli fetch fetch-e2e hidden train storage storage-s3 \
    cuda-emu-selftest cuda-emu-model

stage "valgrind"
run_tests build-gcc --setup=valgrind --suite core

stage "done"
echo "all tests passed"
