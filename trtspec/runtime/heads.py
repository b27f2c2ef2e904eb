"""Head calls: a drafter asks a head (a model role that reads the target's hidden rows; export/head.py)
for its top tokens, and the phase's asks of one head run as one batched forward.

`probs, tokens = yield from ask(head, rows, k)` yields a `HeadCall`, which the scheduler answers with
the phase's other host waits (runner.read_together): the calls of one head (and k) are joined into
one forward, and their answers read with the phase's reads in its one host transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K = 3          # guesses a drafter asks of each head (its top-k): a tree of up to 3 + 9 + 27 ... nodes

@dataclass
class HeadCall:
    head: torch.nn.Module       # top(rows, k) -> (probs, tokens) [N, depth, k]
    rows: torch.Tensor          # [N, hidden]
    k: int
    batcher = None              # not a step of a model with a KV cache


def ask(head, rows: torch.Tensor, k: int):
    """`probs, tokens = yield from ask(head, rows, k)`: host lists [N][depth][k] of the head's top-k."""
    flat = yield HeadCall(head, rows, k)
    n, depth = len(rows), head.spec.depth
    k = len(flat) // (2 * n * depth)
    probs, toks = flat[: n * depth * k], [int(t) for t in flat[n * depth * k:]]
    shape = lambda xs: [[xs[(i * depth + d) * k:(i * depth + d + 1) * k] for d in range(depth)]  # noqa: E731
                        for i in range(n)]
    return shape(probs), shape(toks)


def run_heads(calls: list[HeadCall]) -> list[torch.Tensor]:
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
