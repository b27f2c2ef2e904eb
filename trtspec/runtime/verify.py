"""Verification of a TokenTree against one target forward over all its nodes.

Both rules run where the logits are (the tree must be there too: `tree.to(device)`) and end with
one host read, of (last accepted node, next token): `next_token` is the target's own token at the
last accepted node (the correction, or the bonus token when a leaf was reached). The accepted path
root..last (ascending, the KV rows to commit) then comes from the host's copy of the parents, and
the emitted tokens are tokens[path[1:]] + next.
"""
from __future__ import annotations

import numpy as np
import torch

from .tree import TokenTree


def greedy_choice(tree: TokenTree, target_logits: torch.Tensor) -> torch.Tensor:
    """Longest root path along which every node is the target's argmax at its parent, as a device
    tensor [last node, next token].

    Vectorized: a node survives when neither it nor any ancestor mismatches; the deepest survivor
    wins (siblings carry distinct tokens, so at most one node per depth can survive)."""
    best = target_logits.argmax(-1)                                  # [N]
    mismatch = (tree.tokens != best[tree.parents.clamp(min=0)]) & (tree.parents >= 0)
    alive = ~(tree.ancestors & mismatch.unsqueeze(0)).any(-1)        # [N]
    last = torch.where(alive, tree.depth, -1).argmax()
    return torch.stack([last, best[last]])


def sampling_choice(tree: TokenTree, target_probs: torch.Tensor, gen: torch.Generator,
                    early_exit: bool | None = None) -> torch.Tensor:
    """Exact multi-candidate speculative sampling (SpecInfer / Sequoia recursive rejection), as a
    device tensor [last node, next token].

    At each node, children are tried in order. A child drawn from q is accepted with probability
    min(1, p(y)/q(y)); on rejection p <- norm(max(p - q, 0)). A deterministic child is q = one-hot:
    accepted with probability p(y), else p(y) <- 0 and p is renormalised. With no child accepted the
    token is drawn from what is left of p. Each emitted token is thus an exact sample from the
    target: the rule is lossless however the tree was built, provided q is the distribution the
    child was really drawn from (for siblings drawn without replacement, the renormalised q after
    earlier siblings were removed).

    The walk never reads the device: it takes a fixed number of trials, one per (depth, sibling
    rank) the tree has (`child_table` widths, known on the host), each masked off once the walk has
    moved on or stopped, with every uniform drawn up front (one per trial). `early_exit` (default: on
    the CPU, where the host is the device and a read costs nothing) skips the trials left once the
    walk has moved on or stopped: the same draws, the same result, fewer vector passes."""
    if early_exit is None:
        early_exit = target_probs.device.type == "cpu"
    table, widths = tree.child_table()
    u = torch.rand(sum(widths), generator=gen, device=target_probs.device)
    node = torch.zeros((), dtype=torch.int64, device=target_probs.device)
    stopped = torch.zeros((), dtype=torch.bool, device=target_probs.device)
    p, trial = target_probs[0], 0
    for width in widths:                            # one level per depth the walk can reach
        if early_exit and bool(stopped):
            break
        p = torch.where(stopped, p, target_probs[node])
        moved = torch.zeros_like(stopped)
        for j in range(width):
            if early_exit and bool(moved | (table[node, j] < 0)):
                break
            child = table[node, j]
            live = (child >= 0) & ~moved & ~stopped
            child = child.clamp(min=0)
            y = tree.tokens[child]
            without_y = p.scatter(0, y.view(1), 0.0)                  # the residual for q = one-hot
            if tree.q is None:
                accept, rest = u[trial + j] < p[y], without_y
            else:
                q = tree.q[child]
                one_hot = torch.isnan(q[0])
                accept = torch.where(one_hot, u[trial + j] < p[y], u[trial + j] * q[y] < p[y])
                rest = torch.where(one_hot, without_y, (p - q).clamp_(min=0.0))
            accept = accept & live
            p = torch.where(live & ~accept, rest / rest.sum(), p)
            node = torch.where(accept, child, node)
            moved |= accept
        stopped |= ~moved
        trial += width
    # Only by rounding can all of p's mass sit on rejected candidates (0/0: NaN, every later sibling
    # rejected): then the token is drawn from the node's own p.
    p = torch.where(p.sum() > 0, p, target_probs[node])
    return torch.stack([node, torch.multinomial(p, 1, generator=gen)[0]])


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[np.ndarray, int]:
    """(accepted path, next token) under greedy decoding."""
    last, nxt = greedy_choice(tree, target_logits).tolist()         # the step's one host read
    return tree.path(last), nxt


def verify_sampling(tree: TokenTree, target_probs: torch.Tensor, gen: torch.Generator) -> tuple[np.ndarray, int]:
    """(accepted path, next token) under sampling; `gen` lives on the probabilities' device."""
    last, nxt = sampling_choice(tree, target_probs, gen).tolist()   # the step's one host read
    return tree.path(last), nxt
