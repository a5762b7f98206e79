#!/usr/bin/env bash
# Regenerate abi/libdflash.abi from a gcc build (after an intended ABI change, or at a
# release): every exported function and the types they reach, less what
# include/dflash/experimental.h declares (abi/suppressions). Bump the SONAME in meson.build
# when the change is incompatible, and say what changed in CHANGELOG.md.
#   scripts/update-abi.sh [BUILD_DIR]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
abidw --headers-dir include/dflash --suppressions abi/suppressions --no-corpus-path \
  --out-file abi/libdflash.abi "$build/libdflash.so"
all=$(grep -c "<elf-symbol name='dflash_" abi/libdflash.abi)
exp=$(grep -c "<elf-symbol name='dflash_[a-z_0-9]*' version='DFLASH_EXPERIMENTAL'" abi/libdflash.abi || true)
echo "wrote abi/libdflash.abi: $((all - exp)) stable functions ($exp experimental ones listed, not checked)"
