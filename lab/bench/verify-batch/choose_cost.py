"""(Historical: measures the recursive-rejection walk that keyed draws replaced in 75a40c6; run it
from a checkout before that commit, as its results in docs/benchmarks.md were.)
What choosing a target phase's verifications costs, per phase, before and after one verification
per batch: B requests' trees (the default pair's vocabulary, 151,936) verified together.

  before (CHECKOUT at 35220e9): each request's choice alone (greedy_choice / sampling_choice), then
          the phase's one joined read (effects.resolve)
  after:  verify.choose_together over the phase's Checks, then the same read: either tree by tree
          (the CPU's default: greedy_choice, sampling_choice with early exit) or batched (what a
          GPU runs: greedy rows in one pass over the flattened nodes, sampled rows in one walk of
          WALK_ROWS rows)

    python lab/bench/verify-batch/choose_cost.py OUT.json [BEFORE_CHECKOUT]

Trees are staged-like (a 3-wide first level, chains below, 13 nodes); logits lean towards each
node's first child so walks go deep. Median of 25 phases after 3 warm-ups, 2 threads.
"""
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

here = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(here))
from trtspec.runtime import verify  # noqa: E402
from trtspec.runtime.effects import Read, resolve  # noqa: E402
from trtspec.runtime.sampling import SamplingParams, probs_from_logits  # noqa: E402
from trtspec.runtime.tree import TokenTree  # noqa: E402

torch.set_num_threads(2)
V, REPS, WARM = 151_936, 25, 3
PARENTS = [-1, 0, 0, 0, 1, 4, 5, 6, 2, 8, 9, 3, 11]


def old_verify(checkout: str):
    spec = importlib.util.spec_from_file_location("old_verify", Path(checkout) / "trtspec/runtime/verify.py",
                                                  submodule_search_locations=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["trtspec.runtime.old_verify"] = mod
    mod.__package__ = "trtspec.runtime"
    spec.loader.exec_module(mod)
    return mod


def phase(b: int, sampled: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    trees, scores = [], []
    for i in range(b):
        tokens = torch.randint(V, (len(PARENTS),), generator=g).tolist()
        tree = TokenTree(tokens, PARENTS)
        logits = torch.randn(len(PARENTS), V, generator=g)
        for node, kids in enumerate(tree.children()):
            if kids:
                logits[node, tokens[kids[0]]] = 6.0 if sampled else 30.0
        trees.append(tree)
        scores.append(probs_from_logits(logits, SamplingParams(temperature=1.0)) if sampled else logits)
    return trees, scores


def timed(fn) -> float:
    out = []
    for r in range(WARM + REPS):
        t0 = time.perf_counter()
        fn()
        if r >= WARM:
            out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main(path: str, before: str | None) -> None:
    old = old_verify(before) if before else None
    rows = []
    for sampled in (False, True):
        for b in (1, 4, 8):
            trees, scores = phase(b, sampled, seed=b)
            gens = lambda: [torch.Generator().manual_seed(i) if sampled else None for i in range(b)]   # noqa: E731
            row = {"sampling": "sampled" if sampled else "greedy", "batch": b}
            if old is not None:
                if sampled:
                    row["before_ms"] = timed(lambda: resolve([Read(old.sampling_choice(t, p, g))
                                                                    for t, p, g in zip(trees, scores, gens())]))
                else:
                    row["before_ms"] = timed(lambda: resolve([Read(old.greedy_choice(t, x))
                                                                    for t, x in zip(trees, scores)]))
            checks = lambda: [verify.Check(t, x, g) for t, x, g in zip(trees, scores, gens())]   # noqa: E731
            row["after_ms"] = timed(lambda: resolve(checks()))
            row["after_batched_ms"] = timed(lambda: verify.choose_together(checks(), batched=True).tolist())
            rows.append(row)
            print(json.dumps(row), flush=True)
    json.dump({"machine": "see docs/benchmarks.md", "vocab": V, "tree_nodes": len(PARENTS), "rows": rows},
              open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
