"""DecodeState: one request's sequence, runners, sampling and stats, plus the shared target step.

Every strategy ends a step the same way: build a TokenTree rooted at the last emitted token,
`yield from verify_and_commit(tree)`, and (if it has a draft model) commit the draft's accepted
rows. `ar` is the degenerate case of a one-node tree. A DecodeState belongs to one request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .adaptive import AutoBudget
from .runner import Calls, ModelRunner
from .sampling import SamplingParams, probs_from_logits
from .tree import TokenTree
from .verify import verify_greedy, verify_sampling

CATCH_UP = 16      # a draft further behind than this catches up in prefill chunks (draft_catch_up)


@dataclass
class StepStats:
    tree_size: int
    accepted: int            # drafted tokens accepted (the emitted count is accepted + 1)
    draft_forwards: int
    draft_seconds: float
    verify_seconds: float
    extra: dict = field(default_factory=dict)    # strategy-specific: merges, stage-2 acceptance, ...


@dataclass
class DecodeState:
    target: ModelRunner
    draft: ModelRunner | None
    sampling: SamplingParams
    gen: torch.Generator
    seq: np.ndarray                      # preallocated token buffer: prompt + output
    length: int                          # valid tokens in seq
    steps: list[StepStats] = field(default_factory=list)
    draft_seconds: float = 0.0           # accumulated by the strategy for the current step
    record_trees: bool = False           # keep each step's tree + accepted path (for --show-tree)
    policy: AutoBudget | None = None     # budget: auto (adaptive.py); None = the strategy's fixed budget

    @property
    def root(self) -> int:
        return int(self.seq[self.length - 1])

    def tokens(self) -> np.ndarray:
        return self.seq[: self.length]

    def append(self, toks: list[int]) -> None:
        self.seq[self.length:self.length + len(toks)] = toks
        self.length += len(toks)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.sampling)

    def will_draft(self) -> bool:
        """Whether this step drafts: always with a fixed budget; with budget auto, the policy's call."""
        return self.policy is None or self.policy.begin(self.target.cache.length)

    def draft_catch_up(self) -> Calls:
        """Before a tree opens: a draft cache more than CATCH_UP tokens behind the sequence (prefilled
        lazily under budget auto, so empty at a request's first drafted step; or left behind by a long
        run of ar steps) commits the gap but the root in prefill chunks; the tree's first draft
        forward feeds the rest with the root."""
        cache = self.draft.cache
        if self.length - 1 - cache.length > CATCH_UP:
            yield from self.draft.prefill(self.seq[cache.length:self.length - 1].tolist())

    def ar_step(self) -> Calls:
        """A plain ar step (the policy's budget 0): the root alone. A draft cache left behind catches
        up at the next drafted step (its pending tokens). Returns the emitted tokens."""
        return (yield from self.verify_and_commit(TokenTree.chain(self.root, [])))[0]

    def verify_and_commit(self, tree: TokenTree, draft_forwards: int = 0, **extra) -> Calls:
        """One target forward over `tree`, exact acceptance, target KV commit (a coroutine).
        `node_q` (in extra): each node's draft probability given its parent (NaN: none), which
        calibrates the policy. Returns (emitted tokens, accepted path as tree node indices, root first)."""
        t0 = time.perf_counter()
        tree = tree.to(self.target.engine.device)
        logits = yield from self.target.verify(tree)
        if self.sampling.greedy:
            path, nxt = verify_greedy(tree, logits)
        else:
            path, nxt = verify_sampling(tree, probs_from_logits(logits, self.sampling), self.gen)
        self.target.cache.commit(path)
        emitted = tree.host_tokens[path[1:]].tolist() + [nxt]
        if self.record_trees:
            extra["tree"] = {"tokens": tree.host_tokens.tolist(), "parents": tree.host_parents.tolist(),
                             "path": path.tolist(), "next_token": nxt, **extra.pop("tree_nodes", {})}
        else:
            extra.pop("tree_nodes", None)
        node_q = extra.pop("node_q", None)
        verify_s = time.perf_counter() - t0
        if self.policy is not None:
            extra.update(self.policy.observe(len(tree), path, tree.host_parents, node_q, len(emitted),
                                             self.draft_seconds + verify_s))
        self.steps.append(StepStats(len(tree), len(path) - 1, draft_forwards, self.draft_seconds, verify_s, extra))
        self.draft_seconds = 0.0
        return emitted, path
