"""Head calls: a drafter asks a head (a model role that reads the target's hidden rows; export/head.py)
for its top tokens, and the phase's asks of one head run as one batched forward.

`probs, tokens = yield from effects.ask(head, rows, k)` yields a `HeadCall`, which the scheduler answers
with the phase's other host waits (effects.resolve): the calls of one head (and k) are joined into
one forward, and their answers read with the phase's reads in its one host transfer.
"""
from __future__ import annotations

import torch

TOP_K = 3          # guesses a drafter asks of each head (its top-k): a tree of up to 3 + 9 + 27 ... nodes


def run_heads(calls: list) -> list[torch.Tensor]:
    """Each call's answer on the device (its probs, then its tokens as floats: ids < 2^24 are exact),
    the calls of one head and k joined into one forward."""
    out: list[torch.Tensor | None] = [None] * len(calls)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault((id(c.head), c.k), []).append(i)
    for idx in groups.values():
        first = calls[idx[0]]
        probs, toks = first.head.top(torch.cat([calls[i].rows for i in idx]), first.k)
        at = 0
        for i in idx:
            n = len(calls[i].rows)
            out[i] = torch.cat([probs[at:at + n].flatten(), toks[at:at + n].flatten().to(probs.dtype)])
            at += n
    return out
