"""DecodeState: one request's sequence, runners, sampling (and its grammar state), seed, budget and step stats.

A DecodeState belongs to one request. Strategies read it to propose a tree (strategies/base.py);
the shared step (step.py) verifies the tree, commits both caches and appends the step's stats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .budget import Budget, FixedBudget, Ledger, Values
from .effects import Calls
from .grammar import GrammarState
from .logits import TokenLogprob
from .prefix_cache import PrefixStore
from .runner import ModelRunner
from .sampling import SamplingParams, probs_from_logits

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
    seq: np.ndarray                      # preallocated token buffer: prompt + output
    n_tokens: int                        # valid tokens in seq
    steps: list[StepStats] = field(default_factory=list)
    record_trees: bool = False           # keep each step's tree + accepted path (for --show-tree)
    budget: Budget = field(default_factory=FixedBudget)
    strategy_state: dict = field(default_factory=dict)   # what a strategy keeps for this request (by name)
    prompt_len: int = 0                  # seq[:prompt_len] is the prompt (penalties, min_tokens count the rest)
    stop_ids: frozenset[int] = frozenset()
    grammar: GrammarState | None = None  # the output's grammar, having consumed the output so far
    step_logprobs: list[TokenLogprob] = field(default_factory=list)   # the last step's, when asked for
    draft_store: PrefixStore | None = None   # the draft's prefix store (a lazily prefilled draft restores from it)
    # With a target engine that returns hidden rows (export/contract.py): the rows its LM head read for
    # the last accepted path (or the prompt's last prefilled token), the last of them the row whose
    # logits chose the root: what a drafting head reads. None otherwise.
    hidden: torch.Tensor | None = None
    heads: dict = field(default_factory=dict)   # the generator's head roles, by kind (shared: read only)
    seed: int = 0                        # the request's: its sampled tokens are keyed draws (seed, position)

    @property
    def values(self) -> Values:
        """How proposers score nodes (budget/values.py): the budget's, which calibrates them."""
        return self.budget.values

    @property
    def ledger(self) -> Ledger:
        """This step's facts (budget/plan.py): the proposer grows its tree's values in `ledger.value`,
        the draft's forwards go in `ledger.forwards`; the budget reads them."""
        return self.budget.ledger

    @property
    def root(self) -> int:
        return int(self.seq[self.n_tokens - 1])

    def tokens(self) -> np.ndarray:
        return self.seq[: self.n_tokens]

    def append(self, toks: list[int]) -> None:
        self.seq[self.n_tokens:self.n_tokens + len(toks)] = toks
        self.n_tokens += len(toks)

    def constrain(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """Draft logits [n, V] with what the grammar forbids after each row's path (its tokens after
        the root) at -inf, so the draft never proposes it and a sampled child's q is the masked
        distribution it was really drawn from. `logits` itself without a grammar."""
        if self.grammar is None:
            return logits
        allowed = torch.from_numpy(self.grammar.masks(paths)).to(logits.device)
        return logits.float().masked_fill(~allowed[:, :logits.shape[-1]], float("-inf"))

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.sampling)

    def draft_catch_up(self) -> Calls:
        """Before a tree opens: a draft cache more than CATCH_UP tokens behind the sequence (prefilled
        lazily under budget auto, so empty at a request's first drafted step; or left behind by a long
        run of ar steps) commits the gap but the root in prefill chunks; the tree's first draft
        forward feeds the rest with the root."""
        cache = self.draft.cache
        if self.n_tokens - 1 - cache.length > CATCH_UP:
            store, prompt = self.draft_store, self.seq[:self.prompt_len - 1].tolist()
            if store is not None and cache.length == 0:
                store.reuse(prompt, cache)
            yield from self.draft.prefill(self.seq[cache.length:self.n_tokens - 1].tolist())
            if store is not None:
                store.keep(prompt, cache)

    def pending(self) -> list[int]:
        """Tokens the draft has not seen yet, the root last (fed with the tree's first draft forward)."""
        return self.tokens()[self.draft.cache.length:].tolist()
