#!/usr/bin/env bash
# The include graph between module folders, from the `#include "..."` lines that leave a folder
# (HACKING.md, "Module folders and who may include whom"): one "from -> to" line per pair.
# With --check, exit 1 when a folder includes one that is not below it in the layering
#   core < tokenizer, storage < chat, fetch < dataset < hidden < train < cuda < cuda/emu
# (dataset renders through chat and reads fetch's completions, so it sits above both)
# (tools/ includes no internal header at all; cuda/emu's `include` is its own shims folder).
# src/train's rooms (src/train/cuda, src/train/run) count as train: their headers are
# included by the full path ("train/cuda/dist.h"), and a relative "cuda/..." or "run/..." from
# src/train would read as an edge to another folder and fail the check.
# With --calls BUILD_DIR, the edges are the calls between the library's folders instead: each
# object file of BUILD_DIR's libdflash (one per source file, named src_FOLDER_file.c.o) calls
# the folders that define the symbols it leaves undefined (nm), so a call through a function
# pointer aside, a folder that reaches above itself without including a header fails too
# (issue 41; test `call-graph`, suite abi).
# Usage: scripts/include-graph.sh [--check] [--calls BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
check=0 calls=
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --calls) calls=${2:?--calls needs a build folder}; shift ;;
    *) echo "usage: scripts/include-graph.sh [--check] [--calls BUILD_DIR]" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$calls" ]; then
  objs=$(ls "$calls"/libdflash.so.*.p/src_*.o 2>/dev/null) ||
    { echo "include-graph: no libdflash object files in $calls" >&2; exit 2; }
  # "folder D sym" for each defined global, "folder U sym" for each undefined one.
  edges=$(for o in $objs; do
      f=$(basename "$o"); f=${f#src_}; f=${f%%_*}
      nm -g "$o" | awk -v f="$f" '$1 == "U" { print f, "U", $2 } NF == 3 && $2 ~ /[TDBR]/ { print f, "D", $3 }'
    done | awk '$2 == "D" { def[$3] = $1; next } { use[NR] = $1 " " $3 }
      END { for (i in use) { split(use[i], u, " "); if ((u[2] in def) && def[u[2]] != u[1]) print u[1], def[u[2]] } }' |
    sort -u)
else
  edges=$(git grep -E '^#include "(\.\./)*[a-z_]+/' -- src cuda tools \
    | sed -E 's#^(src/[a-z_]+|tools/[a-z_]+|cuda/emu|cuda)/[^:]*:\#include "(\.\./)*(src/)?([a-z_]+)/.*#\1 \4#' \
    | sed -E 's#^src/##' | awk '$1 != $2' | sort -u)
fi
what=includes; [ -z "$calls" ] || what=calls
[ "$check" = 1 ] || { echo "$edges" | awk '{print $1 " -> " $2}'; exit 0; }
echo "$edges" | awk -v what="$what" '
  BEGIN {
    split("core:0 tokenizer:1 storage:1 chat:2 fetch:2 dataset:3 hidden:4 train:5 cuda:6 cuda/emu:7", l, " ")
    for (i in l) { split(l[i], kv, ":"); rank[kv[1]] = kv[2] }
  }
  $1 == "cuda/emu" && $2 == "include" { next }
  !($1 in rank) || !($2 in rank) || rank[$2] >= rank[$1] {
    printf "include-graph: %s %s %s, which is not below it in the layering\n", $1, what, $2; bad = 1
  }
  END { exit bad }'
