#!/bin/bash
# Issue 65's full run (docs/benchmarks.md, "Hardening IV"): the default pair served on this machine,
#   1. overload + soak: SLOTS slots, a queue of 2 x SLOTS, 4 x SLOTS clients for SECONDS;
#   2. drain: the same for 240 s, SIGTERM to the server at 120 s (drain timeout 300 s);
#   3. Ray Serve, 2 replicas of SLOTS / 2 slots, 4 x SLOTS clients for 240 s, one replica SIGKILLed at 60 s.
# Each phase: python -m trtspec.tools.bench_serve --overload (solo answers first, then the load), one
# server at a time on 127.0.0.1. Exit codes go to OUT/exit.txt.
#
#   lab/bench/overload/run.sh ENGINE_FOLDER OUT [SLOTS] [SECONDS]
set -uo pipefail
engines=$(realpath "$1") out=$(realpath -m "$2") slots=${3:-4} seconds=${4:-600}
py=$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python    # not realpath: a venv python is a link
port=8123 url=http://127.0.0.1:8123/v1
mkdir -p "$out"

serve() {   # NAME, then serve's options; sets $pid once the server listens
  local name=$1; shift
  "$py" -m trtspec.cli serve --engines "$engines" --host 127.0.0.1 --port $port --max-queue $((2 * slots)) \
    --drain-timeout 300 "$@" > "$out/$name.server.log" 2>&1 &
  pid=$!
  until grep -q "serving" "$out/$name.server.log"; do
    sleep 2
    kill -0 $pid 2>/dev/null || { echo "$name: the server did not start" | tee -a "$out/exit.txt"; exit 1; }
  done
}
load() {    # NAME, then bench_serve's options
  local name=$1; shift
  echo "$name $(date -u +%H:%M:%S)" | tee -a "$out/times.txt"
  "$py" -m trtspec.tools.bench_serve --url $url --clients $((4 * slots)) --limit 10 --max-tokens 64 \
    --long-tokens 4000 --output "$out/$name" "$@"
  echo "$name: bench_serve exit $?" | tee -a "$out/exit.txt"
}
stopped() { # NAME: the server's exit status after SIGTERM (sent here unless the load sent it)
  kill -TERM $pid 2>/dev/null; wait $pid; echo "$1: server exit $?" | tee -a "$out/exit.txt"
}

serve overload --threads 2 --max-batch $slots
load overload --overload "$seconds"
stopped overload

serve drain --threads 2 --max-batch $slots
load drain --overload 240 --drain-after 120 --server-pid $pid
wait $pid; echo "drain: server exit $?" | tee -a "$out/exit.txt"

serve ray --threads 1 --max-batch $((slots / 2)) --replicas 2
victim=$(pgrep -f "ServeReplica:trtspec:Engine" | head -1)
load ray --overload 240 --kill-after 60 --kill-pid "$victim" --sample-every 10
stopped ray
