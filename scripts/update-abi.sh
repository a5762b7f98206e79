#!/usr/bin/env bash
# Regenerate abi/libdflash.abi from a gcc build (after an intended ABI change).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
abidw --headers-dir include/dflash --no-corpus-path --out-file abi/libdflash.abi "$build/libdflash.so"
echo "wrote abi/libdflash.abi"
