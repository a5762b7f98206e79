#!/usr/bin/env bash
# The include graph between module folders, from the `#include "..."` lines that leave a folder
# (HACKING.md, "Module folders and who may include whom"): one "from -> to" line per pair.
# With --check, exit 1 when a folder includes one that is not below it in the layering
#   core < tokenizer, storage < chat, fetch, dataset < hidden < train < cuda < cuda/emu
# (tools/ includes no internal header at all; cuda/emu's `include` is its own shims folder).
# src/train's rooms (src/train/cuda, src/train/run) count as train: their headers are
# included by the full path ("train/cuda/dist.h"), and a relative "cuda/..." or "run/..." from
# src/train would read as an edge to another folder and fail the check.
# Usage: scripts/include-graph.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
edges=$(git grep -E '^#include "(\.\./)*[a-z_]+/' -- src cuda tools \
  | sed -E 's#^(src/[a-z_]+|tools/[a-z_]+|cuda/emu|cuda)/[^:]*:\#include "(\.\./)*(src/)?([a-z_]+)/.*#\1 \4#' \
  | sed -E 's#^src/##' | awk '$1 != $2' | sort -u)
[ "${1:-}" = --check ] || { echo "$edges" | awk '{print $1 " -> " $2}'; exit 0; }
echo "$edges" | awk '
  BEGIN {
    split("core:0 tokenizer:1 storage:1 chat:2 fetch:2 dataset:2 hidden:3 train:4 cuda:5 cuda/emu:6", l, " ")
    for (i in l) { split(l[i], kv, ":"); rank[kv[1]] = kv[2] }
  }
  $1 == "cuda/emu" && $2 == "include" { next }
  !($1 in rank) || !($2 in rank) || rank[$2] >= rank[$1] {
    printf "include-graph: %s includes %s, which is not below it in the layering\n", $1, $2; bad = 1
  }
  END { exit bad }'
