"""Generator: loaded engines + KV caches allocated once, reused across requests; streams tokens.

    gen = Generator(target_engine, draft_engine, tokenizer=tok, capacity=2048)
    result = gen.generate(prompt_ids, strategy="chain", max_new_tokens=128)
    for piece in gen.stream_text("def fib(n):", strategy="ngram"): print(piece, end="")
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from ..engines.base import Engine
from ..errors import RequestError
from .decode import DecodeState, StepStats
from .kv_cache import CapacityError
from .runner import ModelRunner
from .sampling import SamplingParams
from .strategies import Strategy, make_strategy


@dataclass
class GenerationResult:
    token_ids: list[int]                 # new tokens only
    stats: dict = field(default_factory=dict)
    steps: list[StepStats] = field(default_factory=list)
    finish_reason: str = "length"        # "stop": a stop token ended it; "length": max_new_tokens did


class Generator:
    def __init__(self, target: Engine, draft: Engine | None = None, tokenizer=None,
                 capacity: int = 2048, stop_ids: set[int] | frozenset = frozenset(),
                 strategy_options: dict[str, dict] | None = None, buckets: dict[str, list[int]] | None = None):
        self.target = ModelRunner(target, capacity, buckets=buckets)
        self.draft = (ModelRunner(draft, capacity, buckets=buckets, vocab=target.spec.vocab_size)
                      if draft is not None else None)
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.stop_ids = set(stop_ids)
        self.strategy_options = strategy_options or {}
        self._seq = np.zeros(capacity, dtype=np.int64)

    def strategy(self, name: str | Strategy) -> Strategy:
        strat = name if isinstance(name, Strategy) else make_strategy(name, **(self.strategy_options.get(name) or {}))
        if strat.max_tree_size() > self.target.max_step_tokens:
            raise RequestError(f"strategy {strat.name!r} can send {strat.max_tree_size()} tokens to the target in "
                             f"one step, more than the {self.target.max_step_tokens} a step allows; "
                             "lower its budget / k in the config")
        if strat.needs_draft and self.draft is None:
            raise RequestError(f"strategy {strat.name!r} needs a draft model, but none is loaded; "
                             "add a draft to the config or use --strategy ar / ngram")
        return strat

    def generate(self, prompt_ids: list[int], **kwargs) -> GenerationResult:
        """Run to completion. kwargs as for `iter_tokens`."""
        it = self.iter_tokens(prompt_ids, **kwargs)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value

    def iter_tokens(self, prompt_ids: list[int], strategy: str | Strategy = "ar", max_new_tokens: int = 128,
                    sampling: SamplingParams = SamplingParams(), seed: int = 0,
                    record_trees: bool = False) -> Iterator[list[int]]:
        """Yield the tokens each target step emits; `self.last_result` holds the result afterwards."""
        strat = self.strategy(strategy)
        if not prompt_ids:
            raise RequestError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_capacity(len(prompt_ids), max_new_tokens, strat, self.capacity)
        for r in (self.target, self.draft):
            if r is not None:
                r.reset()
        gen = torch.Generator().manual_seed(seed)
        st = DecodeState(self.target, self.draft if strat.needs_draft else None, sampling, gen, self._seq, 0,
                         record_trees=record_trees)
        st.append(list(prompt_ids))

        t0 = time.perf_counter()
        # Invariant: each cache holds seq[:-1]; the last token is the root of the next tree.
        self.target.prefill(list(prompt_ids[:-1]))
        if st.draft is not None:
            st.draft.prefill(list(prompt_ids[:-1]))
        prefill_s = time.perf_counter() - t0

        out: list[int] = []
        finish = "length"
        while len(out) < max_new_tokens:
            emitted = strat.step(st)[: max_new_tokens - len(out)]
            stop_at = next((i for i, t in enumerate(emitted) if t in self.stop_ids), None)
            if stop_at is not None:
                emitted = emitted[: stop_at + 1]
            st.append(emitted)
            out += emitted
            yield emitted
            if stop_at is not None:
                finish = "stop"
                break
        seconds = time.perf_counter() - t0
        self.last_result = GenerationResult(out, self._stats(out, st.steps, seconds, prefill_s), st.steps, finish)
        return self.last_result

    @staticmethod
    def _stats(out: list[int], steps: list[StepStats], seconds: float, prefill_s: float) -> dict:
        n = len(steps)
        return {
            "new_tokens": len(out),
            "seconds": seconds,
            "tokens_per_s": len(out) / seconds if seconds > 0 else 0.0,
            "target_steps": n,
            "mean_accepted": (len(out) / n) if n else 0.0,   # tokens emitted per target step
            "draft_seconds": sum(s.draft_seconds for s in steps),
            "verify_seconds": sum(s.verify_seconds for s in steps),
            "prefill_seconds": prefill_s,
            "draft_forwards": sum(s.draft_forwards for s in steps),
            "mean_tree_size": (sum(s.tree_size for s in steps) / n) if n else 0.0,
        }

    def stream_text(self, prompt_ids: list[int], **kwargs) -> Iterator[str]:
        """Yield decoded text pieces as tokens are accepted (needs a tokenizer)."""
        if self.tokenizer is None:
            raise RequestError("stream_text needs a tokenizer")
        toks: list[int] = []
        shown = ""
        for emitted in self.iter_tokens(prompt_ids, **kwargs):
            toks += emitted
            # Re-decode the whole output so multi-token characters come out whole.
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text



def room_for(prompt_len: int, strat: Strategy, capacity: int) -> int:
    """How many new tokens fit after a prompt: the KV rows left once the largest step is reserved."""
    return capacity - prompt_len - strat.max_rows()


def check_capacity(prompt_len: int, max_new_tokens: int, strat: Strategy, capacity: int) -> None:
    """CapacityError unless prompt + output + the largest step (target tree or draft rows) fit the KV."""
    if max_new_tokens > room_for(prompt_len, strat, capacity):
        raise CapacityError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + {strat.name}'s largest step "
            f"({strat.max_rows()} rows: target tree {strat.max_tree_size()}, draft {strat.max_draft_rows()}) = "
            f"{prompt_len + max_new_tokens + strat.max_rows()} tokens exceeds the KV capacity {capacity}; "
            "raise max_seq_len, lower max_new_tokens or shorten the prompt")
