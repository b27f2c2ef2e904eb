"""Verification of a TokenTree against one target forward over all its nodes.

Both rules return (path, next_token): `path` are the accepted node indices root..last (ascending,
the KV rows to commit), and `next_token` is the target's own token at the last accepted node (the
correction, or the bonus token when a leaf was reached). Emitted tokens = tokens[path[1:]] + next.
"""
from __future__ import annotations

import torch

from .tree import TokenTree


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Longest root path along which every node is the target's argmax at its parent.

    Vectorized: a node survives when neither it nor any ancestor mismatches; the deepest survivor
    wins (siblings carry distinct tokens, so at most one node per depth can survive)."""
    best = target_logits.argmax(-1)                                  # [N]
    parents = tree.parents.clamp(min=0)
    mismatch = (tree.tokens != best[parents]) & (tree.parents >= 0)
    alive = ~(tree.ancestors & mismatch.unsqueeze(0)).any(-1)        # [N]
    last = int(torch.where(alive, tree.depth, -1).argmax())
    return tree.path(last), int(best[last])


def verify_sampling(tree: TokenTree, target_probs: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Exact multi-candidate speculative sampling (SpecInfer / Sequoia recursive rejection).

    At each node, children are tried in order. A child drawn from q is accepted with probability
    min(1, p(y)/q(y)); on rejection p <- norm(max(p - q, 0)). A deterministic child is q = one-hot:
    accepted with probability p(y), else p(y) <- 0 and p is renormalised. With no child accepted the
    token is drawn from what is left of p. Each emitted token is thus an exact sample from the
    target: the rule is lossless however the tree was built, provided q is the distribution the
    child was really drawn from (for siblings drawn without replacement, the renormalised q after
    earlier siblings were removed)."""
    kids = tree.children()
    node = 0
    while True:
        p = target_probs[node].clone()
        moved = False
        for c in kids[node]:
            y = int(tree.tokens[c])
            q = None if tree.q is None or torch.isnan(tree.q[c, 0]) else tree.q[c]
            u = float(torch.rand((), generator=gen))
            if q is None:
                if u < float(p[y]):
                    node, moved = c, True
                    break
                p[y] = 0.0
            else:
                if u * float(q[y]) < float(p[y]):
                    node, moved = c, True
                    break
                p = (p - q).clamp_(min=0.0)
            total = p.sum()
            if total <= 0:        # only by rounding: all mass sat on rejected candidates
                p = target_probs[node].clone()
                total = p.sum()
            p /= total
        if not moved:
            return tree.path(node), int(torch.multinomial(p, 1, generator=gen))
