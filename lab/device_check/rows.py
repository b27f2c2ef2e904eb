"""Batch invariance of the rows themselves: each request's logits in a batch of B against the same
call alone, bit for bit, at the setting's padded shapes (so only the batch axis differs). Greedy
outputs can agree while rows differ in their last bits; a sampled acceptance test (u < p/q) can
then flip, which is what this count explains, for the target and for the draft."""
from __future__ import annotations

import torch

from trtspec.runtime.batch import Batcher, Call

BATCHES = (2, 4, 8)
WIDTHS = (1, 4)          # one-token calls (ar, a draft step) and 4-token chains (a verification)
ROOM = len(BATCHES) * sum(WIDTHS)     # the scratch rows the calls leave after a slot's prompt


def batch_rows(engine, buckets: dict | None, capacity: int, longest: int, seed: int = 0) -> dict:
    """{"B=2": [differing calls, calls], ...}: for B in 2, 4, 8 and each call width, B requests at
    random cached lengths (16 to `longest` - ROOM) run together and each alone, on twin KV pools that
    see the same calls in the same order."""
    vocab = engine.spec.vocab_size
    batcher = Batcher(engine, buckets, max_batch=max(BATCHES), capacity=capacity)
    pools = [engine.new_pool(max(BATCHES), capacity + batcher.headroom) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    for slot in range(max(BATCHES)):
        n = int(torch.randint(16, longest - ROOM + 1, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (n,), generator=gen)
        for pool in pools:
            cache = pool.caches[slot]
            batcher.run([Call(batcher, cache, prompt, torch.arange(n), torch.ones(n, n).tril().bool(), None)])
            cache.commit(range(n))
    out: dict[str, list[int]] = {}
    for b in BATCHES:
        differ = calls = 0
        for t in WIDTHS:
            tokens = [torch.randint(0, vocab, (t,), generator=gen) for _ in range(b)]
            together = batcher.run([_call(batcher, pools[0].caches[s], tokens[s]) for s in range(b)])
            together = [x.clone() for x in together]
            for s in range(b):
                alone = batcher.run([_call(batcher, pools[1].caches[s], tokens[s])])[0]
                differ += int(not torch.equal(alone, together[s]))
                calls += 1
        out[f"B={b}"] = [differ, calls]
    return out


def _call(batcher: Batcher, cache, tokens: torch.Tensor) -> Call:
    """A chain after the slot's prompt; the rows earlier calls left (uncommitted) stay masked out."""
    t = tokens.shape[0]
    mask = torch.cat([torch.zeros(t, cache.scratch), torch.ones(t, t).tril()], 1).bool()
    return Call(batcher, cache, tokens, cache.length + torch.arange(t), mask, None)
