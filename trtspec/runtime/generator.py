"""Generator: loaded engines, KV pools with a slot per concurrent request, and the scheduler.

    gen = Generator(target_engine, draft_engine, tokenizer=tok, capacity=2048, slots=4)
    handle = gen.submit(prompt_ids, strategy="chain", max_new_tokens=128)   # any thread
    for tokens in handle: ...                                             # or: async for
    result = handle.result()
    result = gen.generate(prompt_ids, strategy="staged")                  # the simple API
    for piece in gen.stream_text(prompt_ids, strategy="ngram"): print(piece, end="")

Everything is allocated here, once: per model one KV pool (`slots` slots of `capacity` rows plus
batch headroom), per slot a token buffer and its runners, per model one Batcher's step buffers.
Requests run concurrently: each owns a slot while it runs, and the scheduler batches their model
calls (scheduler.py). The simple API rides on `submit`, so two interleaved streams on one
Generator each get exactly their own output.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np

from ..errors import RequestError
from .batch import Batcher
from .costs import CostModel, StoredCosts, load_or_measure, measure
from .engine import Engine
from .grammar import Grammars
from .hooks import Hooks
from .kv_cache import CapacityError
from .prefix_cache import BLOCK, PrefixStore
from .request import GenerationResult, Handle, Request, Slot
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .strategies import Strategy, strategy
from .text import TextStream

__all__ = ["Generator", "GenerationResult", "check_capacity", "room_for"]


class Generator:
    def __init__(self, target: Engine, draft: Engine | None = None, tokenizer=None,
                 capacity: int = 2048, stop_ids: set[int] | frozenset = frozenset(),
                 strategy_options: dict[str, dict] | None = None, buckets: dict[str, list[int]] | None = None,
                 slots: int = 4, max_queue: int | None = None, costs: CostModel | None = None,
                 owns_engines: bool = False, prefix_cache: int | None = None, heads: dict | None = None,
                 hooks: Hooks | None = None, batched_verify: bool | None = None,
                 stored_costs: StoredCosts | None = None, config=None, backend: str = ""):
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.stop_ids = set(stop_ids)
        self.strategy_options = strategy_options or {}
        self.target_engine, self.draft_engine = target, draft
        # hooks: an observer of the scheduler, the batchers and the step (hooks.py); batched_verify:
        # choose a phase's verifications in one pass even on the CPU, as on a GPU (None: by the device)
        self.batchers = {"target": Batcher(target, buckets, max_batch=slots, capacity=capacity, hooks=hooks)}
        if draft is not None:
            self.batchers["draft"] = Batcher(draft, buckets, max_batch=slots, capacity=capacity, hooks=hooks)
        pools = {role: b.engine.new_pool(slots, capacity + b.headroom) for role, b in self.batchers.items()}
        vocab = target.spec.vocab_size
        # Head roles (export/head.py): stateless, shared by every slot, asked by kind by the drafters
        # that read them; their forwards are batched per phase (heads.py). No KV: nothing in the pools.
        self.heads = dict(heads or {})
        self.head_kinds = kinds = {h.spec.kind: h for h in self.heads.values()}
        self.slots = [Slot(i, ModelRunner(self.batchers["target"], pools["target"].caches[i]),
                           ModelRunner(self.batchers["draft"], pools["draft"].caches[i], vocab=vocab)
                           if draft is not None else None,
                           np.zeros(capacity, dtype=np.int64), kinds)
                      for i in range(slots)]
        self.pools = pools
        # Prefix caching: `prefix_cache` prompt tokens per model kept across requests (default: one
        # slot's worth, `capacity`; 0 = off). Only the scheduler thread touches the stores.
        rows = capacity if prefix_cache is None else prefix_cache
        self.stores = {role: PrefixStore(pool, rows) for role, pool in pools.items()} if rows >= BLOCK else {}
        self.grammars = Grammars(tokenizer, vocab, self.stop_ids)     # compiles requests' grammars (structured outputs)
        self.scheduler = Scheduler(self.slots, self.batchers["target"], self.batchers.get("draft"), max_queue,
                                   hooks, batched_verify, costs=self.step_costs, stores=self.stores)
        # Step costs for budget: auto: given, else at the first such request the engine folder's
        # (`stored_costs`, from load_generator: stored, or measured and stored) or measured here.
        self.costs, self.stored_costs = costs, stored_costs
        # What it was loaded from (load_generator: the folder's Config and backend), for the tools that
        # report it (bench, serve); None and "" for a Generator made from engines.
        self.config, self.backend = config, backend
        self._buckets = buckets
        self._costs_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self.closed = False
        self.owns_engines = owns_engines     # load_generator's engines are released by close(); given ones are not
        _open.add(self)

    def step_costs(self) -> CostModel:
        """The step costs budget: auto plans with (load_generator gets them before serving)."""
        with self._costs_lock:
            if self.costs is None and self.stored_costs is not None:
                self.costs = load_or_measure(self.stored_costs.folder, self.target_engine, self.draft_engine,
                                             self.capacity, self.stored_costs.key, self._buckets, heads=self.heads)
            elif self.costs is None:
                self.costs = measure(self.target_engine, self.draft_engine, self.capacity, buckets=self._buckets,
                                     heads=self.heads)
            return self.costs

    def strategy(self, name: str | Strategy, **overrides) -> Strategy:
        """A strategy object: `name` with the config's options, overrides written "staged:budget=12" and
        `overrides` (strategies.strategy: checked runnable with this generator's draft or none, its
        target's hidden rows or none, its heads, and the target's largest step)."""
        return strategy(name, self.strategy_options, has_draft=self.draft_engine is not None,
                        has_hidden=self.target_engine.hidden_rows, heads=set(self.head_kinds),
                        max_step=self.batchers["target"].max_step, **overrides)

    def request(self, prompt_ids: list[int], strategy: str | Strategy = "ar", max_new_tokens: int = 128,
                sampling: SamplingParams = SamplingParams(), seed: int = 0, record_trees: bool = False,
                timeout: float | None = None, ignore_eos: bool = False, stop_token_ids: list[int] = (),
                leader: Request | None = None) -> Request:
        """Queue a request (thread-safe); returns it (`submit` returns its Handle). Bad input raises
        here, in the caller. `timeout`: seconds after which the request is ended with finish_reason "deadline".
        `ignore_eos`: run to max_new_tokens through stop tokens (benchmarks).
        `stop_token_ids`: more tokens that end the output (kept in it, like the model's own stops).
        `sampling` carries the logit rules (penalties, logit_bias, min_tokens, a grammar) and
        `logprobs`; a grammar is compiled here, so a bad one raises here too."""
        strat = self.strategy(strategy)
        if not prompt_ids:
            raise RequestError("the prompt is empty: give at least one token")
        vocab = self.target_engine.spec.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_capacity(len(prompt_ids), max_new_tokens, strat, self.capacity)
        extra = [t for t in stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if extra:
            raise RequestError(f"stop token id {extra[0]!r} is outside the model's vocabulary (0..{vocab - 1})")
        bias = [t for t, _ in sampling.logit_bias if not (isinstance(t, int) and 0 <= t < vocab)]
        if bias:
            raise RequestError(f"logit_bias token id {bias[0]!r} is outside the model's vocabulary (0..{vocab - 1})")
        grammar = None
        if sampling.grammar is not None:
            if ignore_eos:
                raise RequestError("a grammar ends the output with a stop token: it cannot be combined with ignore_eos")
            grammar = self.grammars.start(sampling.grammar)
        stops = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(self.stop_ids))
        if strat.auto_nodes() is not None:
            self.step_costs()            # stored, or measured now: in the caller's thread, not the scheduler's
        req = Request(list(prompt_ids), strat, max_new_tokens, sampling, seed, stops, record_trees,
                      None if timeout is None else time.monotonic() + timeout, grammar=grammar, leader=leader)
        self.scheduler.submit(req)
        return req

    def submit(self, prompt_ids: list[int], **kwargs) -> Handle:
        """Queue a request (thread-safe); returns its Handle. Bad input raises here, in the caller.
        Arguments: `request`'s."""
        return self.request(prompt_ids, **kwargs).handle

    def submit_choices(self, prompt_ids: list[int], n: int, seed: int = 0, **kwargs) -> list[Handle]:
        """`n` choices of one prompt (OpenAI's `n`): one prefill, whose rows the other choices copy
        into their own slots; choice i samples with its own seed (choice 0 with `seed` itself,
        so it equals a lone request's answer; the others with seeds derived from (seed, i)), so
        `seed` reproduces the whole set. Other arguments: `request`'s."""
        if not (isinstance(n, int) and 1 <= n <= len(self.slots) * 4):
            raise RequestError(f"n must be an integer in 1..{len(self.slots) * 4}, got {n!r}")
        reqs = [self.request(prompt_ids, seed=seed, **kwargs)]
        try:
            for i in range(1, n):
                reqs.append(self.request(prompt_ids, seed=choice_seed(seed, i), leader=reqs[0], **kwargs))
        except Exception:
            for r in reqs:                   # all or nothing (e.g. the queue filled up midway)
                r.handle.cancel()
            raise
        return [r.handle for r in reqs]

    def generate(self, prompt_ids: list[int], **kwargs) -> GenerationResult:
        """Run to completion. kwargs as for `submit`."""
        return self.submit(prompt_ids, **kwargs).result()

    def iter_tokens(self, prompt_ids: list[int], **kwargs) -> Iterator[list[int]]:
        """Yield the tokens each target step emits; the generator's return value is the result.
        Leaving the loop early cancels the request."""
        handle = self.submit(prompt_ids, **kwargs)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()
        return handle.result()

    def stream_text(self, prompt_ids: list[int], **kwargs) -> Iterator[str]:
        """Yield decoded text pieces as tokens are accepted (needs a tokenizer); returns the result."""
        if self.tokenizer is None:
            raise RequestError("stream_text needs a tokenizer")
        return (yield from decode_pieces(self.tokenizer, self.iter_tokens(prompt_ids, **kwargs)))

    def close(self) -> None:
        """Stop: cancel what is queued or running, join the scheduler thread, then (engines it owns,
        i.e. load_generator's) release the engines' native resources (ONNX Runtime sessions and
        their thread pools), in that order. Idempotent. Every open Generator is closed this way at
        interpreter exit too (atexit runs before module teardown), so native threads never outlive
        the objects that own them."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        self.scheduler.close()
        if self.owns_engines:
            for engine in (self.target_engine, self.draft_engine):
                if engine is not None:
                    engine.close()
        _open.discard(self)

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_open: weakref.WeakSet[Generator] = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for gen in list(_open):
        gen.close()


def decode_pieces(tokenizer, steps: Iterator[list[int]]) -> Iterator[str]:
    """Text pieces of a stream of token lists, each final (TextStream: a character split across
    tokens comes out whole). Returns the stream's return value."""
    text = TextStream(tokenizer)
    while True:
        try:
            emitted = next(steps)
        except StopIteration as done:
            if tail := text.finish():
                yield tail
            return done.value
        if piece := text.feed(emitted):
            yield piece


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed (i >= 1) of a request seeded `seed`: its own stream, fixed by (seed, i)."""
    return int(np.random.SeedSequence([seed % (1 << 64), i]).generate_state(1, np.uint64)[0] >> 1)


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
