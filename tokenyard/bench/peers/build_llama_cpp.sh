#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench (CPU only) for the peer benchmark (issue 26).
#
# The source is llama.cpp as vendored in the llama-cpp-python source distribution on PyPI (the only
# package registry these machines reach). Everything lands under tokenyard/bench/peers/build/ (git-ignored).
# Idempotent: does nothing when both binaries exist. About 15 minutes on 2 cores; never part of
# `make test`.
#
#   tokenyard/bench/peers/build_llama_cpp.sh            # build (or report the existing binaries)
#   LLAMA_CPP_PY_VERSION=0.3.36 JOBS=2 tokenyard/bench/peers/build_llama_cpp.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${PEERS_BUILD_DIR:-$HERE/build}"
VERSION="${LLAMA_CPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
SRC="$BUILD/llama_cpp_python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"
OUT="$BUILD/llama.cpp-build"
BIN="$OUT/bin"

if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" ]]; then
  echo "llama.cpp binaries present: $BIN (delete $OUT to rebuild)"
  exit 0
fi

mkdir -p "$BUILD"
REPO="$(cd "$HERE/../../.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"

if [[ ! -d "$LLAMA" ]]; then
  SDIST="$BUILD/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$SDIST" ]]; then
    echo "downloading the llama-cpp-python $VERSION source distribution from PyPI"
    "$PYTHON" -m pip download --no-deps --no-binary :all: \
      -d "$BUILD" "llama-cpp-python==$VERSION"
  fi
  tar -xzf "$SDIST" -C "$BUILD"
fi
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no llama.cpp source in $LLAMA" >&2; exit 1; }

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
echo "configuring llama.cpp (Release, CPU only, GGML_NATIVE=ON) in $OUT"
cmake -S "$LLAMA" -B "$OUT" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$BIN"
echo "building llama-server and llama-bench with -j$JOBS (nice 10)"
nice -n 10 cmake --build "$OUT" --config Release -j "$JOBS" --target llama-server llama-bench
ls -l "$BIN/llama-server" "$BIN/llama-bench"
"$BIN/llama-bench" --help >/dev/null
echo "done: $BIN"
