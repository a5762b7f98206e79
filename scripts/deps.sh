#!/usr/bin/env bash
# Installs everything libdflash needs to build and test on a fresh Debian 12 machine.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  meson ninja-build pkg-config gcc clang libclang-rt-14-dev libfuzzer-14-dev \
  libcurl4-openssl-dev libpcre2-dev check libsubunit-dev libjansson-dev libutf8proc-dev \
  libopenblas-dev libssl-dev abigail-tools valgrind python3 python3-pip python3-venv g++ >/dev/null
PY=${PYTHON:-python3}
# llama-cpp-python (examples/pipeline) has no wheel for Linux on PyPI: build
# only its CPU library, portable, without examples/tools/llava (~3-5 min on 2 cores).
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
$PY -m pip install -q --disable-pip-version-check -r "$(dirname "$0")/requirements.txt"
$PY -m pip install -q --disable-pip-version-check --no-deps $(sed -n 's/^# no-deps: \([^ ]*\).*/\1/p' "$(dirname "$0")/requirements.txt")
# The reference environment of tests/train/oracle_reference.py (transformers 5 for
# z-lab's DFlashDraftModel, speculators' converter): a venv that sees the packages
# above (torch included), so only scripts/requirements-ref.txt is added to it.
REF=${DFLASH_REF_VENV:-"$(cd "$(dirname "$0")/.." && pwd)/.venv-ref"}
REQ_REF="$(dirname "$0")/requirements-ref.txt"
[ -x "$REF/bin/python" ] || $PY -m venv --system-site-packages "$REF"
"$REF/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ_REF"
"$REF/bin/python" -m pip install -q --disable-pip-version-check --no-deps $(sed -n 's/^# no-deps: \([^ ]*\).*/\1/p' "$REQ_REF")
