"""The golden runs: every step's tree, accepted path, budget record and output tokens of 432 runs on
the tiny pairs, with fixed cost tables (tests/conftest.py's GPU_LIKE and CPU_LIKE), so that two
checkouts that choose the same trees record the same runs on any machine:

- `trees`: 17 strategy configurations x 2 tiny pairs x 2 prompts x greedy and T = 0.8 x GPU-like and
  CPU-like costs (272 runs);
- `grammar`: the 5 grammars of tests/integration/test_logit_rules.py x every registered strategy x greedy and
  T = 0.8 x both cost tables, on the tiny tokenizer (160 runs; forbidden nodes pruned, forced tokens
  added).

Each run is kept as a digest of its canonical JSON (floats to 10 significant digits: a budget
record's last bits are not a change of behaviour; a change of any token, tree, path or count is).
The timing-dependent `measured_gain` is left out. The process's suffix stores (drafters/suffix.py: one
trie per scope, shared by every Generator) are emptied before each set, so that what ran before in
the process cannot change a set; within a set they fill in the set's order, as a server's would.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(TESTS), str(TESTS / "integration")]             # conftest and its neighbours, run as a script
from conftest import CPU_LIKE, GPU_LIKE, SMALL_NOISE, SMALL_VOCAB, make_pair  # noqa: E402

from trtspec.runtime.drafters import suffix
from trtspec.runtime.sampling import SamplingParams

STRATEGIES = ["chain", "chain:k=3", "staged", "staged:suffix=true", "staged:budget=8", "dyspec",
              "dyspec:variant=threshold", "dyspec:budget=8", "gsd", "gsd:budget=10", "cascade", "cascade:suffix=true",
              "cascade:k_draft=3", "suffix", "suffix:budget=6", "ngram", "ar"]
COSTS = {"gpu": GPU_LIKE, "cpu": CPU_LIKE}


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.10g}")
    if isinstance(x, dict):
        return {str(k): _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def digest(run: dict) -> str:
    text = json.dumps(_rounded(run), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _steps(result) -> list[dict]:
    """Each step's record: its tree's size, the drafts it accepted, the draft forwards it ran, and its
    strategy's and budget's facts (all but the measured gain, a timing)."""
    return [{"size": s.tree_size, "accepted": s.accepted, "draft_forwards": s.draft_forwards,
             **{k: v for k, v in s.extra.items() if k != "measured_gain"}} for s in result.steps]


def trees() -> dict[str, dict]:
    """The 272 strategy runs, by 'costs|pair|strategy|prompt|sampling'."""
    suffix.forget()
    pairs = {"llama": make_pair("llama", 512, 2, 0),
             "small": make_pair("llama", vocab_size=SMALL_VOCAB, num_layers=2, seed=0, noise=SMALL_NOISE)}
    rng = random.Random(0)
    prompts = {"llama": [[3, 17, 99, 250, 401, 7] * 5, [rng.randrange(512) for _ in range(20)]],
               "small": [[1, 3, 5, 7, 2, 11] * 4, [rng.randrange(16) for _ in range(12)]]}
    out = {}
    for costs_name, costs in COSTS.items():
        for name, pair in pairs.items():
            gen = pair.generator(capacity=256, costs=costs)
            try:
                for s in STRATEGIES:
                    for pi, p in enumerate(prompts[name]):
                        for samp, sp in (("greedy", SamplingParams()), ("t0.8", SamplingParams(temperature=0.8))):
                            r = gen.generate(p, strategy=s, max_new_tokens=40, sampling=sp, seed=5, record_trees=True)
                            out[f"{costs_name}|{name}|{s}|{pi}|{samp}"] = {"ids": r.token_ids, "steps": _steps(r)}
            finally:
                gen.close()
    return out


def grammar() -> dict[str, dict]:
    """The 160 runs under a grammar, by 'costs|grammar index|strategy|temperature'."""
    from test_logit_rules import GRAMMARS, LARK_NUM, ROOT

    from trtspec.export.tokenizer import load_tokenizer
    from trtspec.runtime.strategies import STRATEGIES as REGISTERED

    suffix.forget()
    pair = make_pair("llama", vocab_size=512, num_layers=2, seed=0)
    tok = load_tokenizer(ROOT / "trtspec" / "assets" / "tiny-tokenizer")
    prompt = tok.encode("hello world, the answer is")
    out = {}
    for costs_name, costs in COSTS.items():
        gen = pair.generator(capacity=256, tokenizer=tok, stop_ids={0}, costs=costs)
        try:
            for gi, g in enumerate([*GRAMMARS, LARK_NUM]):
                for name in REGISTERED:
                    for temp in (0.0, 0.8):
                        r = gen.generate(prompt, strategy=name, max_new_tokens=32, seed=7, record_trees=True,
                                         sampling=SamplingParams(grammar=g, temperature=temp))
                        out[f"{costs_name}|{gi}|{name}|{temp}"] = {"ids": r.token_ids, "steps": _steps(r)}
        finally:
            gen.close()
    return out


SETS = {"trees": trees, "grammar": grammar}


if __name__ == "__main__":          # the whole records, to see what changed: record.py SET OUT.json
    Path(sys.argv[2]).write_text(json.dumps(SETS[sys.argv[1]](), indent=0, sort_keys=True, default=str))
