#!/usr/bin/env bash
# Installs everything libdflash needs to build and test on a fresh Debian 12 machine.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  meson ninja-build pkg-config gcc clang libclang-rt-14-dev libfuzzer-14-dev \
  libcurl4-openssl-dev libpcre2-dev check libsubunit-dev libjansson-dev libutf8proc-dev \
  libopenblas-dev libssl-dev abigail-tools valgrind python3 python3-pip >/dev/null
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check -r "$(dirname "$0")/requirements.txt"
