#!/bin/bash
# A/B of step costs: graph revision 1 (cat of the past) vs 2 (past read in place), ABBA per point.
# usage: NEW=ENGINES OLD=OLD_ENGINES bash lab/bench/attention-inplace/ab.sh (from the repo root)
OUT=docs/bench/attention-inplace/ab.jsonl; : > $OUT
for role in target draft; do
  for c in 256 1024 2000; do
    order="old new new old"; [ $role = draft ] && order="old new"
    for f in $order; do
      E=$NEW; [ $f = old ] && E=$OLD
      .venv/bin/python -m lab.stepcost --engines $E --role $role --tokens 1,4,16 --cached $c --threads 2 --repeats 5 2>/dev/null \
        | sed "s/^{/{\"graph\": \"$f\", /" >> $OUT
    done
  done
done
