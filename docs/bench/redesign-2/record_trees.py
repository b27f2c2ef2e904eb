"""Every step's tree, accepted path, budget record and output tokens of 272 runs on the tiny pairs:
17 strategy configurations x 2 prompts x greedy and T = 0.8 x GPU-like and CPU-like costs
(tests/conftest.py's GPU_LIKE and CPU_LIKE). Two checkouts that choose the same trees write
byte-identical files (the timing-dependent `measured_gain` is left out).

    python docs/bench/redesign-2/record_trees.py OUT.json [CHECKOUT] [--greedy-only]   # CHECKOUT: default, this one
    cmp before.json after.json

`--greedy-only` records the 136 greedy runs alone (a change to sampled draws then cannot reach
them through the Generator's shared suffix store).
"""
import json
import random
import sys
from pathlib import Path

greedy_only = "--greedy-only" in sys.argv
args = [a for a in sys.argv[1:] if a != "--greedy-only"]
repo = Path(args[1] if len(args) > 1 else Path(__file__).resolve().parents[3])
sys.path[:0] = [str(repo / "tests"), str(repo)]
import conftest as C  # noqa: E402
from trtspec.runtime.sampling import SamplingParams  # noqa: E402

STRATEGIES = ["chain", "chain:k=3", "staged", "staged:suffix=true", "staged:budget=8", "dyspec",
              "dyspec:variant=threshold", "dyspec:budget=8", "gsd", "gsd:budget=10", "cascade", "cascade:suffix=true",
              "cascade:k_draft=3", "suffix", "suffix:budget=6", "ngram", "ar"]
pairs = {"llama": C.make_pair("llama", 512, 2, 0),
         "small": C.make_pair("llama", vocab_size=C.SMALL_VOCAB, num_layers=2, seed=0, noise=C.SMALL_NOISE)}
rng = random.Random(0)
prompts = {"llama": [[3, 17, 99, 250, 401, 7] * 5, [rng.randrange(512) for _ in range(20)]],
           "small": [[1, 3, 5, 7, 2, 11] * 4, [rng.randrange(16) for _ in range(12)]]}
out = {}
for costs_name, costs in (("gpu", C.GPU_LIKE), ("cpu", C.CPU_LIKE)):
    for arch, pair in pairs.items():
        gen = pair.generator(capacity=256, costs=costs)
        for s in STRATEGIES:
            for pi, p in enumerate(prompts[arch]):
                for samp in ("greedy",) if greedy_only else ("greedy", "t0.8"):
                    sp = SamplingParams() if samp == "greedy" else SamplingParams(temperature=0.8)
                    r = gen.generate(p, strategy=s, max_new_tokens=40, sampling=sp, seed=5, record_trees=True)
                    steps = [{k: v for k, v in st.extra.items() if k != "measured_gain"} for st in r.steps]
                    out[f"{costs_name}|{arch}|{s}|{pi}|{samp}"] = {"ids": r.token_ids, "steps": steps}
json.dump(out, open(args[0], "w"), indent=0, sort_keys=True, default=str)
print(len(out), "runs")
