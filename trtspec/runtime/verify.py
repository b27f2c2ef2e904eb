"""Verification of TokenTrees against one target forward over all their nodes.

A step hands its tree and the target's scores at every node (logits under greedy decoding, else
probabilities) to `effects.check`, which yields a `Check`; the scheduler chooses every Check of a target
phase together (`choose_together`: greedy rows in one pass over the flattened nodes, sampled rows in
one walk, each request drawing from its own generator) and reads the results with the phase's other
reads in one transfer (effects.resolve). Each result is (last accepted node, next token):
`next_token` is the target's own token at the last accepted node (the correction, or the bonus token
when a leaf was reached). The accepted path root..last (ascending, the KV rows to commit) then comes
from the host's copy of the parents, and the emitted tokens are tokens[path[1:]] + next.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .tree import TokenTree

# A sampled walk runs over this many rows, padded, whatever the batch: its reductions (a row's
# residual mass, the final draw's cumulative sum) then have one shape, so a request's draws come out
# the same whatever shares its batch (as the batcher pads the LM head's rows per token bucket).
WALK_ROWS = 8


def choose_together(checks: list, batched: bool | None = None) -> torch.Tensor:
    """[C, 2] device tensor of (last node, next token) per Check, in order. With `batched` (default:
    off the CPU) greedy checks are chosen in one pass over their flattened nodes and sampled ones in
    one walk per WALK_ROWS requests; on the CPU, where the host is the device, a kernel launch costs
    nothing and a read is free, request by request (the sampled walk with early exit): the same
    draws and results, less work (docs/benchmarks.md, "One verification per batch")."""
    if batched is None:
        batched = checks[0].scores.device.type != "cpu"
    out: list[torch.Tensor | None] = [None] * len(checks)
    greedy = [i for i, c in enumerate(checks) if c.gen is None]
    sampled = [i for i, c in enumerate(checks) if c.gen is not None]
    if greedy:
        group = [checks[i] for i in greedy]
        rows = greedy_choices([c.tree for c in group], [c.scores for c in group]) if batched else \
            [greedy_choice(c.tree, c.scores) for c in group]
        for i, row in zip(greedy, rows):
            out[i] = row
    if sampled:
        group = [checks[i] for i in sampled]
        rows = sampling_choices([c.tree for c in group], [c.scores for c in group], [c.gen for c in group]) \
            if batched else [sampling_choice(c.tree, c.scores, c.gen) for c in group]
        for i, row in zip(sampled, rows):
            out[i] = row
    return torch.stack(out)


def greedy_choices(trees: list[TokenTree], logits: list[torch.Tensor]) -> torch.Tensor:
    """[B, 2]: per tree, the longest root path along which every node is the target's argmax at its
    parent (last node, next token), for all trees at once over their flattened nodes.

    A node survives when neither it nor any ancestor mismatches; each tree's deepest survivor wins
    (siblings carry distinct tokens, so at most one node per depth can survive)."""
    dev = trees[0].device
    sizes = np.array([len(t) for t in trees])
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parents = np.concatenate([np.where(t.host_parents >= 0, t.host_parents + o, -1) for t, o in zip(trees, off)])
    host = np.stack([parents, np.concatenate([t.host_depth for t in trees]), np.repeat(np.arange(len(trees)), sizes)])
    parents, depth, seg = torch.from_numpy(host).to(dev)                   # one copy, host -> device
    tokens = torch.cat([t.tokens for t in trees])
    best = torch.cat([x.argmax(-1) for x in logits])                       # [sum N]
    alive = _alive(tokens, parents, torch.block_diag(*[t.ancestors for t in trees]), best)
    n = len(tokens)                                  # deepest survivor per tree: max of depth * n + index
    key = torch.where(alive, depth * n + torch.arange(n, device=dev), -1)
    last = torch.full((len(trees),), -1, dtype=torch.int64, device=dev).scatter_reduce(0, seg, key, "amax") % n
    return torch.stack([last - torch.from_numpy(off).to(dev), best[last]], -1)


def greedy_choice(tree: TokenTree, target_logits: torch.Tensor) -> torch.Tensor:
    """greedy_choices of one tree, with its own tensors (no flattening): a device tensor [last node,
    next token]."""
    best = target_logits.argmax(-1)                                  # [N]
    last = torch.where(_alive(tree.tokens, tree.parents, tree.ancestors, best), tree.depth, -1).argmax()
    return torch.stack([last, best[last]])


def _alive(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """[N] bool: the nodes neither of which nor of whose ancestors the token differs from the target's
    argmax at its parent (a root, parent -1, always survives)."""
    mismatch = (tokens != best[parents.clamp(min=0)]) & (parents >= 0)
    return ~(ancestors & mismatch.unsqueeze(0)).any(-1)


def sampling_choice(tree: TokenTree, target_probs: torch.Tensor, gen: torch.Generator,
                    early_exit: bool | None = None) -> torch.Tensor:
    """sampling_choices of one tree: a device tensor [last node, next token]. `early_exit` (default:
    on the CPU, where a read costs nothing) stops the walk once it has moved on or stopped."""
    if early_exit is None:
        early_exit = target_probs.device.type == "cpu"
    return _walk([tree], [target_probs], [gen], 1, early_exit)[0]


def sampling_choices(trees: list[TokenTree], probs: list[torch.Tensor], gens: list[torch.Generator]) -> torch.Tensor:
    """[B, 2]: exact multi-candidate speculative sampling of every tree (`_walk`), WALK_ROWS at a time."""
    return torch.cat([_walk(trees[i:i + WALK_ROWS], probs[i:i + WALK_ROWS], gens[i:i + WALK_ROWS], WALK_ROWS, False)
                      for i in range(0, len(trees), WALK_ROWS)])


@dataclass
class _Forest:
    """Up to `rows` trees' nodes flattened for one walk, padded to `rows` rows, and each row's draws."""
    probs: torch.Tensor             # [sum N, V] every node's target probabilities
    q: torch.Tensor | None          # [sum N, V] each node's proposal distribution (NaN: deterministic)
    tokens: torch.Tensor            # [sum N]
    table: torch.Tensor             # [sum N, k] each node's children, in order (flat indices; -1 past them)
    widths: list[int]               # the most children of any node at each depth (host)
    u: torch.Tensor                 # [rows, depth * k] each row's trial uniforms, trial (d, j) at d * k + j
    final: torch.Tensor             # [rows, 1] float64, each row's uniform for its last token
    start: torch.Tensor             # [rows] each row's root (0 for a pad row)
    pad: torch.Tensor               # [rows] bool: a pad row, which never moves


def _forest(trees, probs, gens, rows: int) -> _Forest:
    """The trees flattened, laid out on the host and copied to the device in one go; each request
    draws from its own generator, in its own order: one uniform per trial its own tree has (depth by
    depth, sibling by sibling), then one for its last token."""
    dev, b = probs[0].device, len(trees)
    off = np.concatenate([[0], np.cumsum([len(t) for t in trees])]).astype(np.int64)
    parents = np.concatenate([np.where(t.host_parents >= 0, t.host_parents + o, -1) for t, o in zip(trees, off)])
    depth = np.concatenate([t.host_depth for t in trees])
    child = np.flatnonzero(parents >= 0)
    counts = np.bincount(parents[child], minlength=len(parents))
    widths = np.zeros(int(depth.max()) + 1, dtype=np.int64)
    np.maximum.at(widths, depth, counts)
    k = max(int(widths.max()), 1)
    by_parent = np.argsort(parents[child], kind="stable")        # siblings in node order
    grouped = parents[child][by_parent]
    rank = np.empty_like(child)
    rank[by_parent] = np.arange(len(child)) - np.searchsorted(grouped, grouped)
    table = np.full((len(parents), k), -1, dtype=np.int64)
    table[parents[child], rank] = child
    trials = []                                   # each tree's trials (d, j) at d * k + j of its row
    for i, t in enumerate(trees):
        own = np.zeros(len(widths), dtype=np.int64)
        np.maximum.at(own, t.host_depth, counts[off[i]:off[i + 1]])
        trials.append(np.concatenate([i * len(widths) * k + d * k + np.arange(w) for d, w in enumerate(own)]))
    host = np.concatenate([table.ravel(), off[:-1], *trials])
    sizes = [table.size, b, len(host) - table.size - b]
    table_d, start_d, at = torch.from_numpy(host).to(dev).split(sizes)         # one copy, host -> device
    u = torch.ones(rows * len(widths) * k, device=dev)
    u[at] = torch.cat([torch.rand(len(x), generator=g, device=dev) for x, g in zip(trials, gens)])
    final = torch.zeros(rows, 1, dtype=torch.float64, device=dev)
    final[:b] = torch.cat([torch.rand(1, 1, dtype=torch.float64, generator=g, device=dev) for g in gens])
    start = torch.zeros(rows, dtype=torch.int64, device=dev)
    start[:b] = start_d
    cat = (lambda xs: xs[0]) if b == 1 else torch.cat             # one tree: no copy
    flat, tokens = cat(probs), cat([t.tokens for t in trees])
    q = None
    if any(t.q is not None for t in trees):       # a tree with no q: every child deterministic (NaN rows)
        q = cat([t.q if t.q is not None else flat.new_full((len(t), flat.shape[1]), float("nan")) for t in trees])
    return _Forest(flat, q, tokens, table_d.view(len(parents), k), widths.tolist(), u.view(rows, -1), final,
                   start, torch.arange(rows, device=dev) >= b)


def _walk(trees, probs, gens, rows: int, early_exit: bool) -> torch.Tensor:
    """Exact multi-candidate speculative sampling (SpecInfer / Sequoia recursive rejection) of up to
    `rows` trees at once, padded to `rows`: [len(trees), 2] (last node, next token).

    At each node, children are tried in order. A child drawn from q is accepted with probability
    min(1, p(y)/q(y)); on rejection p <- norm(max(p - q, 0)). A deterministic child is q = one-hot:
    accepted with probability p(y), else p(y) <- 0 and p is renormalised. With no child accepted the
    token is drawn from what is left of p. Each emitted token is thus an exact sample from the
    target: the rule is lossless however the tree was built, provided q is the distribution the
    child was really drawn from (for siblings drawn without replacement, the renormalised q after
    earlier siblings were removed).

    The walk never reads the device: it takes a fixed number of trials, one per (depth, sibling
    rank) any tree has (widths known on the host), each masked off once a tree's walk
    has moved on or stopped, with every uniform drawn up front (`_forest`). With `early_exit` it
    skips the trials left once every row has moved on or stopped: the same draws, the same result,
    fewer vector passes."""
    f = _forest(trees, probs, gens, rows)
    node, stopped, k = f.start, f.pad, f.table.shape[1]
    p = f.probs[node]
    for d, width in enumerate(f.widths):          # one level per depth a walk can reach
        if early_exit and bool(stopped.all()):
            break
        p = torch.where(stopped.unsqueeze(1), p, f.probs[node])
        moved = torch.zeros_like(stopped)
        for j in range(width):
            child = f.table[node, j]
            live = (child >= 0) & ~moved & ~stopped
            if early_exit and not bool(live.any()):
                break
            child = child.clamp(min=0)
            p, accept = _trial(f, p, child, live, f.u[:, d * k + j])
            node = torch.where(accept, child, node)
            moved |= accept
        stopped |= ~moved
    return torch.stack([node - f.start, _draw(p, f.probs[node], f.final)], -1)[:len(trees)]


def _trial(f: _Forest, p: torch.Tensor, child: torch.Tensor, live: torch.Tensor, u: torch.Tensor):
    """Each live row tries its `child`: (p after the trial, whether the child was accepted)."""
    y = f.tokens[child].unsqueeze(1)
    py = p.gather(1, y)[:, 0]
    without_y = p.scatter(1, y, 0.0)                                     # the residual for q = one-hot
    if f.q is None:
        accept, rest = u < py, without_y
    else:
        q = f.q[child]
        one_hot = torch.isnan(q[:, 0])
        accept = torch.where(one_hot, u < py, u * q.gather(1, y)[:, 0] < py)
        rest = torch.where(one_hot.unsqueeze(1), without_y, (p - q).clamp_(min=0.0))
    accept = accept & live
    return torch.where((live & ~accept).unsqueeze(1), rest / rest.sum(-1, keepdim=True), p), accept


def _draw(p: torch.Tensor, own: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[rows] each row's last token, drawn from what is left of p by inverse CDF (`final`: a uniform
    per row). Only by rounding can all of p's mass sit on rejected candidates (0/0: NaN, every later
    sibling rejected): then the token is drawn from the node's own p (`own`)."""
    p = torch.where(p.sum(-1, keepdim=True) > 0, p, own)
    cdf = p.double().cumsum(-1)
    total = cdf[:, -1:]
    # the first token whose cumulative mass passes the draw; never one past the last token with mass
    return torch.minimum(torch.searchsorted(cdf, final * total, right=True), (cdf < total).sum(-1, keepdim=True))[:, 0]


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[np.ndarray, int]:
    """(accepted path, next token) under greedy decoding."""
    last, nxt = greedy_choice(tree, target_logits).tolist()         # the step's one host read
    return tree.path(last), nxt


def verify_sampling(tree: TokenTree, target_probs: torch.Tensor, gen: torch.Generator) -> tuple[np.ndarray, int]:
    """(accepted path, next token) under sampling; `gen` lives on the probabilities' device."""
    last, nxt = sampling_choice(tree, target_probs, gen).tolist()   # the step's one host read
    return tree.path(last), nxt
