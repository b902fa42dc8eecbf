#!/usr/bin/env bash
# Build llama.cpp's Python bindings (llama-cpp-python, which compiles llama.cpp from source) once,
# keep the wheel in ~/.cache/mamba-debug/wheels/, install it into $PYTHON (default python3), and unpack llama.cpp's own
# HF -> GGUF converter (convert_hf_to_gguf.py + its gguf-py) into ~/.cache/mamba-debug/llamacpp-src/ for the agreement tests.
#
#   tests/llamacpp/build.sh            # build if no cached wheel, then install; quick no-op when already done
#   FORCE=1 tests/llamacpp/build.sh    # rebuild the wheel even if one is cached
#
# First run: about 9 minutes on 2 cores (CPU-only build, no CUDA, no mtmd/llava, no tools).
# Later runs: a few seconds (pip install from the cached wheel), or nothing when already installed.
# The wheel name carries the version; the .key file next to it records the CMake flags it was built with.
# GGML_NATIVE=OFF keeps the cached wheel portable between x86-64 machines (AVX2/FMA/F16C baseline).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# Kept outside the checkout so a fresh clone on the same machine (CI) reuses the build.
CACHE="${MAMBA_DEBUG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mamba-debug}"
WHEELS="${LLAMACPP_WHEEL_DIR:-$CACHE/wheels}"
SRC="$CACHE/llamacpp-src"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
FLAGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
KEY="llama-cpp-python==$VERSION $FLAGS"
SDIST="$WHEELS/llama_cpp_python-$VERSION.tar.gz"

installed() {
    "$PYTHON" - "$VERSION" <<'PY' 2>/dev/null
import sys
import llama_cpp
sys.exit(0 if llama_cpp.__version__ == sys.argv[1] else 1)
PY
}

mkdir -p "$WHEELS"
fetch_sdist() {
    if [[ ! -s "$SDIST" ]]; then
        echo "downloading the llama-cpp-python $VERSION source distribution (~75 MB, llama.cpp included)"
        "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$WHEELS" "llama-cpp-python==$VERSION"
    fi
}

# llama.cpp's converter (pure Python) from the same source distribution
if [[ ! -f "$SRC/$VERSION/convert_hf_to_gguf.py" ]]; then
    fetch_sdist
    rm -rf "$SRC" && mkdir -p "$SRC/$VERSION"
    top="llama_cpp_python-$VERSION/vendor/llama.cpp"
    tar -xzf "$SDIST" -C "$SRC/$VERSION" --strip-components=3 \
        "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "$top/models/ggml-vocab-gpt-neox.gguf"
    echo "llama.cpp converter unpacked in $SRC/$VERSION"
fi

if [[ -z "${FORCE:-}" ]] && installed; then
    echo "llama-cpp-python $VERSION already importable by $PYTHON; nothing to build"
    exit 0
fi

wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -n "${FORCE:-}" || -z "$wheel" || "$(cat "$WHEELS/llama_cpp_python-$VERSION.key" 2>/dev/null)" != "$KEY" ]]; then
    fetch_sdist
    rm -f "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl
    echo "building llama-cpp-python $VERSION from source into $WHEELS ($JOBS jobs; takes several minutes)"
    start=$(date +%s)
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" "$PYTHON" -m pip wheel --no-deps -w "$WHEELS" "$SDIST"
    echo "$KEY" > "$WHEELS/llama_cpp_python-$VERSION.key"
    echo "built in $(( $(date +%s) - start )) s"
    wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
fi

echo "installing $wheel"
"$PYTHON" -m pip install --force-reinstall --no-deps "$wheel"
# runtime dependencies of the bindings (small, pure Python; most are usually present already)
"$PYTHON" -m pip install "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3"
installed && echo "llama-cpp-python $VERSION installed for $PYTHON"
