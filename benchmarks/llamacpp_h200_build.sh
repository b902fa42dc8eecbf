#!/usr/bin/env bash
# On the H200 machine: build llama.cpp (the source llama-cpp-python 0.3.36 vendors, carried as
# build/llama-src.tar.gz) with CUDA for sm_90 into build/llama-cuda/bin, once per machine.
# FlashAttention and NCCL kernels are left out: the Mamba graphs use neither, and they triple the build time.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=build/llama-cuda
if [[ -f $OUT_DIR/bin/libllama.so ]]; then echo "llama.cpp CUDA build already in $OUT_DIR/bin"; exit 0; fi
# built outside this checkout: llama.cpp's CMake reads its commit from the enclosing git repository, which here
# would be mamba-debug's (the source archive has none: the library must say "unknown")
WORK=${TMPDIR:-/tmp}/mamba-debug-llama-cuda
rm -rf $OUT_DIR $WORK && mkdir -p $OUT_DIR $WORK/src
tar xzf build/llama-src.tar.gz -C $WORK/src
t0=$(date +%s)
cmake -S $WORK/src -B $WORK/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF > $WORK/cmake.log 2>&1 || { tail -30 $WORK/cmake.log; exit 1; }
cmake --build $WORK/b -j "$(nproc)" > $WORK/build.log 2>&1 || { tail -40 $WORK/build.log; exit 1; }
mkdir -p $OUT_DIR/bin && cp -P $WORK/b/bin/*.so* $OUT_DIR/bin/
echo "built llama.cpp with CUDA in $(( $(date +%s) - t0 )) s:"; ls -la $OUT_DIR/bin
