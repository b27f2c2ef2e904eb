"""Issue 42, drafters as parts: the 272 recorded tiny-pair runs before and after, compared.

    python tests/integration/golden/record.py trees before.json      (in the checkout before)
    python tests/integration/golden/record.py trees after.json
    python lab/bench/drafters-as-parts/compare_records.py before.json after.json

Two changes of form are undone before comparing: a recorded tree's `source` is now the drafters'
names (it was indices into the old fixed tuple below), and a strategy whose drafter has no scored
candidates no longer reports `suffix_match: 0`. Anything else that differs is printed.
"""
import json
import sys

OLD = ("draft", "suffix", "review", "ngram", "grammar")
before, after = (json.load(open(p)) for p in sys.argv[1:3])
differ = dropped = 0
for key, a in before.items():
    b = after[key]
    for sa, sb in zip(a["steps"], b["steps"]):
        if "source" in sa.get("tree", {}):
            sa["tree"]["source"] = [OLD[i] for i in sa["tree"]["source"]]
        if "suffix_match" in sa and "suffix_match" not in sb and sa["suffix_match"] == 0:
            dropped += 1
            del sa["suffix_match"]
    if a != b:
        differ += 1
        print("differs:", key)
print(f"{len(before)} runs; {differ} differ; `suffix_match: 0` no longer reported in {dropped} steps")
