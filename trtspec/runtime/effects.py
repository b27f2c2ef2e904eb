"""What a request's coroutine waits on besides a model step, and the one resolver of them all.

A strategy, a drafter or the step is a coroutine of model calls (runner.py): it yields a `Call` (a
step with KV, batch.py) or one of the effects below, and receives the answer:

    host = yield from read(tensor)            a device tensor's values on the host (`Read`)
    last, nxt = yield from check(tree, s, g)  a tree verified (`Check`: verify.py chooses)
    probs, toks = yield from ask(head, r, k)  a head's top-k (`HeadCall`: heads.py runs them)

The scheduler resolves every waiting effect of a phase together (`resolve`: the Checks chosen in
one pass, each head's calls in one forward, everything read in one host transfer, i.e. one device
sync for the batch). `drive(coro)` runs a coroutine alone, each call as its own step and each
effect alone (tools and tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Generator as Coroutine

import torch

from .heads import run_heads
from .tree import TokenTree
from .verify import choose_together

if TYPE_CHECKING:
    from .batch import Call


@dataclass
class Read:
    """A device tensor one request needs on the host, waiting to be read with its batch's."""
    tensor: torch.Tensor
    batcher = None                  # not a model call


@dataclass
class Check:
    """One request's verification, waiting to be chosen with its phase's others (verify.choose_together)."""
    tree: TokenTree                 # on the scores' device
    scores: torch.Tensor            # [N, V]: the target's logits (greedy) or probabilities (sampled)
    key: tuple[int, int] | None     # sampled: (the request's seed, the position of the root's next token)
    batcher = None


@dataclass
class HeadCall:
    """A drafter's ask of a head (export/head.py): its top-k guesses for the hidden rows."""
    head: torch.nn.Module           # top(rows, k) -> (probs, tokens) [N, depth, k]
    rows: torch.Tensor              # [N, hidden]
    k: int
    batcher = None                  # not a step of a model with a KV cache


EFFECTS = (Read, Check, HeadCall)
Calls = Coroutine["Call | Read | Check | HeadCall", "torch.Tensor | list", object]   # a coroutine of model calls


def read(tensor: torch.Tensor) -> Calls:
    """`host = yield from read(t)`: t's values as a flat Python list. Integer values come back as ints
    (exact below 2^53)."""
    return (yield Read(tensor))


def check(tree: TokenTree, scores: torch.Tensor, key: tuple[int, int] | None = None) -> Calls:
    """`last, nxt = yield from check(tree, scores, key)`: the accepted node and the next token, chosen
    and read with the phase's other requests' (key None: greedy, scores are logits)."""
    last, nxt = yield Check(tree, scores, key)
    return last, nxt


def ask(head, rows: torch.Tensor, k: int) -> Calls:
    """`probs, tokens = yield from ask(head, rows, k)`: host lists [N][depth][k] of the head's top-k."""
    flat = yield HeadCall(head, rows, k)
    n, depth = len(rows), head.spec.depth
    k = len(flat) // (2 * n * depth)
    probs, toks = flat[: n * depth * k], [int(t) for t in flat[n * depth * k:]]
    shape = lambda xs: [[xs[(i * depth + d) * k:(i * depth + d + 1) * k] for d in range(depth)]  # noqa: E731
                        for i in range(n)]
    return shape(probs), shape(toks)


def resolve(waiting: list, batched: bool | None = None) -> list[list]:
    """Every Read's values, every Check's choice (chosen together; `batched`: verify.choose_together)
    and every HeadCall's answer (one forward per head), with one host transfer: flattened, joined as
    float64 where they are (one device sync), split back, integer tensors' values as ints."""
    checks = [w for w in waiting if isinstance(w, Check)]
    chosen = iter(choose_together(checks, batched) if checks else ())
    heads = [w for w in waiting if isinstance(w, HeadCall)]
    answered = iter(run_heads(heads) if heads else ())
    flat = [(next(chosen) if isinstance(w, Check) else next(answered) if isinstance(w, HeadCall) else w.tensor
             ).reshape(-1) for w in waiting]
    host = torch.cat([x.to(torch.float64) for x in flat]).tolist() if flat else []
    out, i = [], 0
    for x in flat:
        part = host[i:i + x.numel()]
        out.append([int(v) for v in part] if not x.dtype.is_floating_point else part)
        i += x.numel()
    return out


def drive(coro: Calls, batched: bool | None = None):
    """Run a coroutine of model calls to its end, each call (and each effect) alone; returns its value."""
    try:
        call = next(coro)
        while True:
            call = coro.send(resolve([call], batched)[0] if isinstance(call, EFFECTS) else call.batcher.run([call])[0])
    except StopIteration as done:
        return done.value
