#!/usr/bin/env bash
# needed.sh CORE_LIB MODULE: libdflash lists no CUDA library in its dynamic section (NEEDED),
# the CUDA backend module does (so this reads the right files and can fail).
set -euo pipefail
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
cuda='^lib(cudart|cublas|cublasLt|nccl|cuda)\.so'
core=$(needed "$1")
mod=$(needed "$2")
echo "$1 NEEDED:" $core
echo "$2 NEEDED:" $mod
if grep -E "$cuda" <<<"$core"; then echo "FAIL: $1 needs the CUDA libraries above"; exit 1; fi
for lib in libcudart libcublas; do
  grep -q "^$lib\.so" <<<"$mod" || { echo "FAIL: $2 does not need $lib"; exit 1; }
done
echo "ok"
