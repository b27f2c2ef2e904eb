"""The default pair built without and with target.hidden_rows (argv: the two folders): the same tokens
under ar and staged, staged equal to ar, and the second folder's target returning its rows."""
import sys
import time

import torch
from trtspec.assembly.load import load_generator
from trtspec.tools.datasets import load_prompts
from trtspec.runtime.prompts import encode
torch.set_num_threads(2)
prompts = load_prompts("humaneval", limit=4)
out = {}
for name in sys.argv[1:3]:          # the folder without hidden rows, then the one with them
    gen = load_generator(name)
    tok = gen.tokenizer
    res = []
    for p in prompts:
        ids = encode(p, tok)
        for s in ("ar", "staged"):
            t = time.time()
            r = gen.generate(ids, strategy=s, max_new_tokens=64)
            res.append((p.id, s, r.token_ids, len(r.steps), round(time.time() - t, 2)))
    print(name, "hidden_rows:", gen.target_engine.hidden_rows,
          "rows:", None if gen.target_engine.hidden is None else tuple(gen.target_engine.hidden.shape))
    out[name] = res
    gen.close()
a, b = out.values()
for x, y in zip(a, b):
    print(x[0], x[1], "same" if x[2] == y[2] else "DIFFERENT", "steps", x[3], y[3], "s", x[4], y[4])
ars = {(x[0]): x[2] for x in a if x[1] == "ar"}
print("staged == ar on both:", all(x[2] == ars[x[0]] for x in a + b))
