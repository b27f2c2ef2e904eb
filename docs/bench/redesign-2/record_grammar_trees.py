"""Every step's tree under a grammar (forbidden nodes pruned, forced tokens added), its output tokens
and forced-token counts: 160 runs on the tiny pair (the 5 grammars of tests/test_logit_rules.py x
every registered strategy x greedy and T = 0.8 x GPU-like and CPU-like costs). Two checkouts that
build the same trees write byte-identical files (fixed cost tables: with measured costs the
budget's choices follow the machine's timings).
    python docs/bench/redesign-2/record_grammar_trees.py OUT.json CHECKOUT
    cmp before.json after.json
"""
import json
import sys
from pathlib import Path
repo = Path(sys.argv[2])
sys.path[:0] = [str(repo / "tests"), str(repo)]
from conftest import CPU_LIKE, GPU_LIKE, make_pair  # noqa: E402
from test_logit_rules import GRAMMARS, ROOT, LARK_NUM
from trtspec.export.tokenizer import load_tokenizer
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import STRATEGIES

pair = make_pair("llama", vocab_size=512, num_layers=2, seed=0)
tok = load_tokenizer(ROOT / "trtspec" / "assets" / "tiny-tokenizer")
out = []
for costs in (GPU_LIKE, CPU_LIKE):
    g = pair.generator(capacity=256, tokenizer=tok, stop_ids={0}, costs=costs)
    try:
        for gi, grammar in enumerate([*GRAMMARS, LARK_NUM]):
            for name in STRATEGIES:
                for temp in (0.0, 0.8):
                    sp = SamplingParams(grammar=grammar, temperature=temp)
                    r = g.generate(tok.encode("hello world, the answer is"), strategy=name, max_new_tokens=32,
                                   sampling=sp, seed=7, record_trees=True)
                    out.append({"costs": "gpu" if costs is GPU_LIKE else "cpu", "grammar": gi, "strategy": name,
                                "t": temp, "tokens": r.token_ids,
                                "trees": [s.extra.get("tree") for s in r.steps],
                                "forced": [s.extra.get("forced", 0) for s in r.steps]})
    finally:
        g.close()
Path(sys.argv[1]).write_text(json.dumps(out))
print(len(out), "runs,", sum(sum(o["forced"]) for o in out), "forced tokens")
