#!/bin/bash
# End-to-end at a long context: a 1,697-token prompt, 128 new tokens, graph revision 1 vs 2, ABBA.
# usage: NEW=ENGINES OLD=OLD_ENGINES bash lab/bench/attention-inplace/long.sh (from the repo root)
OUT=docs/bench/attention-inplace/long.jsonl; : > $OUT
PROMPT=$(mktemp); git show d5309ad:trtspec/runtime/scheduler.py | head -166 > $PROMPT   # 1,697 tokens of code
for s in ar staged; do
  for f in old new new old; do
    E=$NEW; [ $f = old ] && E=$OLD
    .venv/bin/trtspec run --engines $E --prompt-file $PROMPT --strategy $s --max-new-tokens 128 --threads 2 --json 2>/dev/null \
      | python3 -c "import sys,json; d=json.load(sys.stdin); print(json.dumps({'graph':'$f','strategy':'$s','stats':d['stats'],'ids':d['token_ids'][:8], 'n':len(d['token_ids'])}))" >> $OUT
  done
done
