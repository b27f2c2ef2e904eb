"""Verification of TokenTrees against one target forward over all their nodes.

A step hands its tree and the target's scores at every node (logits under greedy decoding, else
probabilities) to `effects.check`, which yields a `Check`; the scheduler chooses every Check of a target
phase together (`choose_together`, one pass over the flattened nodes) and reads the results with the
phase's other reads in one transfer (effects.resolve). Each result is (last accepted node, next
token): `next_token` is the target's own token at the last accepted node (the correction, or the
bonus token when a leaf was reached). The accepted path root..last (ascending, the KV rows to commit)
then comes from the host's copy of the parents, and the emitted tokens are tokens[path[1:]] + next.

The target's own token at a node is its argmax (greedy) or its draw (sampled): the inverse CDF of
the node's distribution at a uniform keyed by (the request's seed, the position the token takes)
(sampling.keyed_uniforms). A drafted token is accepted when it is that token. So each emitted token
is an exact sample of the target's distribution at its position (a fresh uniform per position), and
the same one whatever the tree, the batch, the shared history or the device: a seeded request's
answer is its `ar` answer, under any strategy and any load (docs/design.md, "Runtime and
strategies"). A draft token drawn from q with the same uniform (chain, dyspec) is accepted as often
as the two inverse CDFs agree; deterministic children (top-k) exactly as often as under recursive
rejection.
"""
from __future__ import annotations

import numpy as np
import torch

from .sampling import inverse_cdf, keyed_draw, keyed_uniforms
from .tree import TokenTree


def choose_together(checks: list, batched: bool | None = None) -> torch.Tensor:
    """[C, 2] device tensor of (last node, next token) per Check, in order. With `batched` (default:
    off the CPU) the checks are chosen in one pass over their flattened nodes; on the CPU, where a
    kernel launch costs nothing, tree by tree: the same results either way (each node's token is its
    own row's argmax, or its own row's keyed draw)."""
    if batched is None:
        batched = checks[0].scores.device.type != "cpu"
    if not batched:
        return torch.stack([greedy_choice(c.tree, c.scores) if c.key is None else
                            sampling_choice(c.tree, c.scores, c.key) for c in checks])
    sampled = [c for c in checks if c.key is not None]
    if sampled:                                  # their uniforms (verify.drawn's) reach the device in one copy
        host = np.concatenate([keyed_uniforms(c.key[0], positions(c.tree, c.key)) for c in sampled])
        u = iter(torch.from_numpy(host).to(checks[0].scores.device).split([len(c.tree) for c in sampled]))
    best = [c.scores.argmax(-1) if c.key is None else inverse_cdf(c.scores, next(u)) for c in checks]
    return _choices([c.tree for c in checks], best)


def drawn(tree: TokenTree, probs: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """[N] the target's sampled token at every node: its row of `probs` by inverse CDF, with the
    uniform keyed by (seed, the position that token takes: key's start + the node's depth). A token
    so depends on its seed, its position and its distribution alone, never on the tree around it,
    the batch or the device: a sampled request's tokens are the ones `ar` draws, one per step."""
    return keyed_draw(probs, key[0], positions(tree, key))


def positions(tree: TokenTree, key: tuple[int, int]) -> np.ndarray:
    """[N] the position each node's token takes: key's start + the node's depth (its draw's key)."""
    return key[1] + tree.host_depth


def greedy_choices(trees: list[TokenTree], logits: list[torch.Tensor]) -> torch.Tensor:
    """[B, 2]: per tree, the longest root path along which every node is the target's argmax at its
    parent (last node, next token), for all trees at once over their flattened nodes."""
    return _choices(trees, [x.argmax(-1) for x in logits])


def _choices(trees: list[TokenTree], best: list[torch.Tensor]) -> torch.Tensor:
    """[B, 2]: per tree, the longest root path along which every node is the target's token (`best`:
    per tree, per node) at its parent, and that token at the path's end.

    A node survives when neither it nor any ancestor mismatches; each tree's deepest survivor wins
    (siblings carry distinct tokens, so at most one node per depth can survive)."""
    dev = trees[0].device
    sizes = np.array([len(t) for t in trees])
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parents = np.concatenate([np.where(t.host_parents >= 0, t.host_parents + o, -1) for t, o in zip(trees, off)])
    host = np.stack([parents, np.concatenate([t.host_depth for t in trees]), np.repeat(np.arange(len(trees)), sizes)])
    parents, depth, seg = torch.from_numpy(host).to(dev)                   # one copy, host -> device
    tokens = torch.cat([t.tokens for t in trees])
    best = torch.cat(best)                                                 # [sum N]
    alive = _alive(tokens, parents, torch.block_diag(*[t.ancestors for t in trees]), best)
    n = len(tokens)                                  # deepest survivor per tree: max of depth * n + index
    key = torch.where(alive, depth * n + torch.arange(n, device=dev), -1)
    last = torch.full((len(trees),), -1, dtype=torch.int64, device=dev).scatter_reduce(0, seg, key, "amax") % n
    return torch.stack([last - torch.from_numpy(off).to(dev), best[last]], -1)


def greedy_choice(tree: TokenTree, target_logits: torch.Tensor) -> torch.Tensor:
    """greedy_choices of one tree, with its own tensors (no flattening): a device tensor [last node,
    next token]."""
    return _choice(tree, target_logits.argmax(-1))


def sampling_choice(tree: TokenTree, target_probs: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """The sampled choice of one tree: the longest root path along which every node is the target's
    keyed draw at its parent (`drawn`), and that draw at its end: [last node, next token]."""
    return _choice(tree, drawn(tree, target_probs, key))


def _choice(tree: TokenTree, best: torch.Tensor) -> torch.Tensor:
    last = torch.where(_alive(tree.tokens, tree.parents, tree.ancestors, best), tree.depth, -1).argmax()
    return torch.stack([last, best[last]])


def _alive(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """[N] bool: the nodes neither of which nor of whose ancestors the token differs from the target's
    argmax at its parent (a root, parent -1, always survives)."""
    mismatch = (tokens != best[parents.clamp(min=0)]) & (parents >= 0)
    return ~(ancestors & mismatch.unsqueeze(0)).any(-1)


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[np.ndarray, int]:
    """(accepted path, next token) under greedy decoding."""
    last, nxt = greedy_choice(tree, target_logits).tolist()         # the step's one host read
    return tree.path(last), nxt


def verify_sampling(tree: TokenTree, target_probs: torch.Tensor, key: tuple[int, int]) -> tuple[np.ndarray, int]:
    """(accepted path, next token) under sampling; `key`: (seed, the position of the root's next token)."""
    last, nxt = sampling_choice(tree, target_probs, key).tolist()   # the step's one host read
    return tree.path(last), nxt
