"""Which recorded runs changed between two record files (`python tests/integration/golden/record.py trees OUT.json`):
per (strategy, sampling), the runs with the same tokens, the same step records and the same trees.

    python lab/bench/plan-per-round/difftrees.py before.json after.json
"""
import json, sys, collections
a, b = (json.load(open(f)) for f in sys.argv[1:3])
by = collections.defaultdict(lambda: [0, 0, 0, 0])
for k in a:
    costs, arch, s, pi, samp = k.split("|")
    row = by[(s, samp)]
    row[0] += 1
    row[1] += a[k]["ids"] == b[k]["ids"]
    ta = [(st.get("tree"), st.get("path")) for st in a[k]["steps"]]
    tb = [(st.get("tree"), st.get("path")) for st in b[k]["steps"]]
    row[2] += a[k]["steps"] == b[k]["steps"]
    row[3] += ta == tb
for (s, samp), (n, ids, steps, trees) in sorted(by.items()):
    if ids < n or steps < n:
        print(f"{s:28s} {samp:7s} runs {n}  same tokens {ids}  same steps {steps}  same trees {trees}")
print("total runs", len(a))
