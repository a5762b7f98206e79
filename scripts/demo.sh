#!/usr/bin/env bash
# Installs dependencies, builds libdflash and runs the main job.
# For now the main job is a small demo: write a checkpoint-shaped safetensors
# file through the C API, then list it with `dflash inspect`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--no-deps" ] || scripts/deps.sh
export PATH="$PATH:/usr/local/cuda/bin"
if [ -f build/build.ninja ]; then meson setup --reconfigure build >/dev/null; else meson setup build >/dev/null; fi
ninja -C build
mkdir -p out
build/examples/write_safetensors out/demo.safetensors
build/tools/dflash/dflash inspect out/demo.safetensors
