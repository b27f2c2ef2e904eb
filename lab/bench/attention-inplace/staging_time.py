"""Time spent staging B > 1 rows (BatchStaging.past) in 8 concurrent `ar` requests, incremental vs full.

    .venv/bin/python lab/bench/attention-inplace/staging_time.py {64|1} ENGINES
"""
import sys, time, json, torch
from trtspec.assembly.load import load_generator
from trtspec.runtime import batch
from trtspec.tools.datasets import load_prompts, encode

rows = int(sys.argv[1])                  # STAGING_ROWS: 64 (incremental) or 1 (a new layout every step)
batch.STAGING_ROWS = rows
torch.set_num_threads(2)
gen = load_generator(sys.argv[2], threads=2)
tok = gen.tokenizer
prompts = [encode(p, tok) for p in load_prompts("humaneval", limit=8)]
st = gen.target_engine.staging
stats = {"calls": 0, "s": 0.0}
orig = st.past
def timed(caches, c):
    t0 = time.perf_counter(); out = orig(caches, c); stats["s"] += time.perf_counter() - t0; stats["calls"] += 1
    return out
st.past = timed
gen.generate(prompts[0], max_new_tokens=4, ignore_eos=True)          # warm-up
st.copied_rows = 0; stats.update(calls=0, s=0.0)
t0 = time.perf_counter()
hs = [gen.submit(p, max_new_tokens=64, ignore_eos=True) for p in prompts]
res = [h.result() for h in hs]
wall = time.perf_counter() - t0
print(json.dumps({"STAGING_ROWS": rows, "wall_s": round(wall, 2), "tok_s": round(8 * 64 / wall, 2),
                  "staged_steps": stats["calls"], "staging_s": round(stats["s"], 3),
                  "ms_per_staged_step": round(1e3 * stats["s"] / max(1, stats["calls"]), 2),
                  "rows_copied_per_staged_step": round(st.copied_rows / max(1, stats["calls"]), 1),
                  "tokens": [r.token_ids[:3] for r in res][:2]}))
gen.close() if hasattr(gen, "close") else None
