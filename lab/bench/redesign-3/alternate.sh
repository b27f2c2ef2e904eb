#!/bin/bash
# The default pair before and after a change, alternated (issue 63's last evidence; docs/benchmarks.md,
# "Redesign III ends"): the folder's step costs measured again first, alone, then the HumanEval
# 20 x 128 bench from each checkout in turn, one job at a time.
#
#   git worktree add /tmp/before af7ab18 && git worktree add /tmp/after 3ff8958
#   lab/bench/redesign-3/alternate.sh /tmp/before /tmp/after ENGINE_FOLDER OUT
#
# Each run imports trtspec from its own checkout (PYTHONPATH) with this checkout's virtualenv.
set -euo pipefail
before=$(realpath "$1") after=$(realpath "$2") engines=$(realpath "$3") out=$(realpath -m "$4")
py=$(realpath "$(dirname "$0")/../../../.venv/bin/python")
mkdir -p "$out"
(cd "$after" && PYTHONPATH="$after" "$py" -m trtspec.cli inspect --engines "$engines" --measure-costs --threads 2)
for run in before1 after1 before2 after2; do
  src=$before; [[ $run == after* ]] && src=$after
  echo "$run $(date -u +%H:%M:%S) $src" | tee -a "$out/times.txt"
  (cd "$src" && PYTHONPATH="$src" "$py" -m trtspec.cli bench --config qwen2.5-coder-1.5b --engines "$engines" \
     --threads 2 --peers none --dataset humaneval --limit 20 --max-new-tokens 128 --strategies staged \
     --output "$out/$run")
done
