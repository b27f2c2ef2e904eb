#!/bin/sh
# The fifteenth session's race, one dataset after another (docs/benchmarks.md, "Where a token's time
# goes on this VM"): lab/bench/race-noamx/run.sh ENGINES OUT   (llama.cpp from `make llama-cpp`)
set -e
engines=$1 out=$2
run() {
    trtspec bench --config qwen2.5-coder-1.5b --engines "$engines" --threads 2 --max-new-tokens 128 "$@"
}
run --peers llama.cpp,llama.cpp-spec,ortgenai --dataset humaneval --limit 20 --strategies staged \
    --output "$out/humaneval"
run --peers llama.cpp,llama.cpp-spec,ortgenai --dataset mtbench --stride 4 --limit 20 --strategies staged \
    --output "$out/mtbench"
run --peers llama.cpp,llama.cpp-ngram-mod --dataset humaneval-edit --limit 10 --strategies staged,suffix \
    --output "$out/edit"
