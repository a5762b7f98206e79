#!/usr/bin/env bash
# Lists the C/C++ sources that clang-format (with the repository's .clang-format) would
# change, with how many of its lines would be rewritten; exits 1 if there is one.
#   scripts/check-format.sh [--diff] [FILE...]   (default: every tracked .c .h .cu .cuh .cpp)
# --diff also prints what would change. Version 14 (Debian bookworm's clang-format, pinned by
# scripts/deps.sh) is required: other versions lay out the same options differently.
# CLANG_FORMAT names another binary. To reformat instead: clang-format -i FILE...
set -euo pipefail
show_diff=0
if [ "${1:-}" = "--diff" ]; then show_diff=1; shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)

cf=${CLANG_FORMAT:-}
if [ -z "$cf" ]; then
  cf=clang-format-14
  command -v "$cf" >/dev/null || cf=clang-format
fi
command -v "$cf" >/dev/null || { echo "check-format: $cf not found (apt-get install clang-format-14)" >&2; exit 2; }
version=$("$cf" --version)
case "$version" in
  *"version 14."*) ;;
  *) echo "check-format: $cf is '$version'; version 14 is required" >&2; exit 2 ;;
esac

files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(git -C "$root" ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cpp' | sed "s|^|$root/|")
fi

bad=0
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for f in "${files[@]}"; do
  [ -f "$f" ] || { echo "check-format: $f: no such file" >&2; exit 2; }
  # --style=file: the .clang-format found from the file's folder upwards.
  "$cf" --style=file "$f" >"$tmp"
  cmp -s "$f" "$tmp" && continue
  d=$(diff "$f" "$tmp" || true)
  echo "${f#"$root"/}: $(grep -c '^<' <<<"$d" || true) lines would change (into $(grep -c '^>' <<<"$d" || true))"
  [ "$show_diff" = 1 ] && diff -u --label "$f" --label "$f (clang-format)" "$f" "$tmp" || true
  bad=$((bad + 1))
done
if [ "$bad" -gt 0 ]; then
  echo "check-format: $bad of ${#files[@]} files differ from clang-format's layout" >&2
  exit 1
fi
