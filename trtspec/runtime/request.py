"""A request, its run and its handle: everything one generation owns, and how its caller follows it.

`Request` is what was asked, request data only: the prompt, strategy, sampling settings and seed,
stops, deadline, grammar, the choice it leads or follows. `Run` is the same request while it runs,
made by the scheduler when a slot takes it: its slot (KV rows of the target and draft, token
buffer), the generator's collaborators it needs (step costs, the batch view, the prefix stores),
its coroutine and the call it waits on, its DecodeState (RNG, budget), the tokens it emitted and its
result. Nothing of either lives on a shared object. `Run.lifecycle` is one coroutine of model calls
(prefill, then strategy steps until a stop token or `max_new_tokens`), advanced by the scheduler.

`Handle` is what `Generator.submit` returns, safe to use from any thread: iterate it (or `async for`,
in one event loop) for the tokens of each step, `cancel()` it, or wait for `result()`. Leaving a
loop early does not cancel the request: call `cancel()` (Generator.iter_tokens does).
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .batch import Call
from .budget import BatchView, make_budget
from .costs import CostModel
from .decode import DecodeState, StepStats
from .effects import Calls
from .grammar import GrammarState
from .logits import TokenLogprob
from .runner import ModelRunner
from .sampling import SamplingParams
from .step import step
from .strategies import Strategy

_ids = itertools.count(1)


@dataclass
class GenerationResult:
    token_ids: list[int]                 # new tokens only
    stats: dict = field(default_factory=dict)
    steps: list[StepStats] = field(default_factory=list)
    finish_reason: str = "length"        # stop | length | cancelled | deadline
    logprobs: list[TokenLogprob] | None = None    # one per new token, when SamplingParams.logprobs asked


class Emitted(list):
    """One step's tokens as a Handle yields them (a list of ids), with their `logprobs` when asked."""

    def __init__(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None):
        super().__init__(tokens)
        self.logprobs = logprobs


@dataclass
class Slot:
    """Preallocated per-request resources, handed to one request at a time."""
    index: int
    target: ModelRunner
    draft: ModelRunner | None
    seq: np.ndarray                      # token buffer: prompt + output
    heads: dict = field(default_factory=dict)   # the generator's head roles by kind (shared, stateless)

    def reset(self) -> None:
        for r in (self.target, self.draft):
            if r is not None:
                r.reset()


class Handle:
    """A submitted request, seen from its caller (any thread)."""

    def __init__(self, request_id: int):
        self.id = request_id
        self._events: queue.Queue = queue.Queue()        # for `for` (any thread)
        self._lock = threading.Lock()
        self._aqueue: asyncio.Queue | None = None         # for `async for`, bound to its event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self.cancelled = False

    # -- written by the scheduler thread ---------------------------------------------------------
    def _push(self, item: list[int] | None) -> None:
        with self._lock:
            if self._aqueue is None:
                self._events.put(item)
            else:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)

    def _tokens(self, toks: list[int]) -> None:
        self._push(toks)

    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()
        self._push(None)

    # -- for the caller --------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the request; its slot is freed before the scheduler's next model call."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __iter__(self) -> Handle:
        return self

    def _get(self) -> list[int] | None:
        """The next step's tokens, or None at the end (raising the request's error, if any)."""
        item = self._events.get()
        if item is None:
            self._events.put(None)               # later calls end too
            if self._error is not None:
                raise self._error
        return item

    def __next__(self) -> list[int]:
        item = self._get()
        if item is None:
            raise StopIteration
        return item

    def __aiter__(self) -> Handle:
        return self

    async def __anext__(self) -> list[int]:
        if self._aqueue is None:                     # first use: move to an asyncio queue
            with self._lock:
                self._loop, self._aqueue = asyncio.get_running_loop(), asyncio.Queue()
                while not self._events.empty():
                    self._aqueue.put_nowait(self._events.get_nowait())
        item = await self._aqueue.get()
        if item is None:
            self._aqueue.put_nowait(None)            # later calls end too
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return item


@dataclass
class Request:
    """What was asked: request data only (and the handle its caller follows it by)."""
    prompt: list[int]
    strategy: Strategy
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    record_trees: bool = False
    deadline: float | None = None        # time.monotonic() after which the request is ended
    grammar: GrammarState | None = None  # its own matcher, when sampling.grammar is set
    leader: Request | None = None        # for choices 2..n of one request: the choice whose prompt rows it copies
    id: int = field(default_factory=lambda: next(_ids))
    handle: Handle = field(init=False)

    def __post_init__(self) -> None:
        self.handle = Handle(self.id)

    def unstarted(self, finish: str) -> GenerationResult:
        """The result of a request that ended before it started (cancelled or expired while waiting)."""
        return self.result(finish)

    def result(self, finish: str, out: list[int] = (), steps: list[StepStats] = (), seconds: float = 0.0,
               prefill_s: float = 0.0, cached: int = 0, logprobs: list[TokenLogprob] = ()) -> GenerationResult:
        """Its result: what it emitted, its steps and timings (nothing, if it never ran)."""
        numbers = {**stats(list(out), list(steps), seconds, prefill_s), "cached_prompt_tokens": cached}
        return GenerationResult(list(out), numbers, list(steps), finish,
                                list(logprobs) if self.sampling.logprobs is not None else None)


@dataclass
class Run:
    """A request while it runs: its slot, its coroutine and the call it waits on, what it emitted, its
    DecodeState, timings. The scheduler makes one when the request starts and drops it when it ends;
    the generator's collaborators (step costs, the batch view, the prefix stores) come with it."""
    request: Request
    slot: Slot
    costs: CostModel | None = None       # the generator's step costs (budget: auto)
    batch: BatchView | None = None       # the scheduler's view of the last target phase (budget: auto)
    stores: dict | None = None           # role -> PrefixStore: prompt rows kept across requests (prefix caching)
    leader: Run | None = None            # the leader's run, if it ran (its slot holds the prompt rows to copy)
    coro: Calls | None = None
    call: Call | None = None             # the model call it waits on
    out: list[int] = field(default_factory=list)
    out_logprobs: list[TokenLogprob] = field(default_factory=list)
    state: DecodeState | None = None
    t0: float = 0.0
    prefill_s: float = 0.0
    prefilled: bool = False              # its prompt rows are in its slot (choices waiting on it may start)
    cached_tokens: int = 0               # prompt tokens not prefilled: loaded from the prefix store or the leader

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def handle(self) -> Handle:
        return self.request.handle

    @property
    def deadline(self) -> float | None:
        return self.request.deadline

    def lifecycle(self) -> Calls:
        """Prefill, then strategy steps until a stop token or max_new_tokens (runs in its slot)."""
        req, slot = self.request, self.slot
        strat = req.strategy
        slot.reset()
        budget = make_budget(strat.auto_nodes(), self.costs, self.batch, req.id, req.max_new_tokens,
                             strat.reads_heads)
        st = DecodeState(slot.target, slot.draft if strat.needs_draft else None, req.sampling, slot.seq, 0,
                         record_trees=req.record_trees, budget=budget, prompt_len=len(req.prompt),
                         stop_ids=req.stop_ids, grammar=req.grammar, heads=slot.heads, seed=req.seed)
        self.state = st
        st.append(list(req.prompt))
        self.t0 = time.perf_counter()
        # Invariant: the target cache holds seq[:-1]; the last token is the root of the next tree. The
        # draft cache may lag (catching up when a tree opens): under budget auto it is prefilled only
        # at the request's first drafted step, so a request that never drafts (a full batch) never
        # pays for it.
        st.hidden = yield from self.prefill(st.target, "target")   # the prompt's last prefilled row (hidden rows)
        if st.draft is not None and not budget.adaptive:
            yield from self.prefill(st.draft, "draft")
        st.draft_store = (self.stores or {}).get("draft") if st.draft is not None else None
        self.prefilled = True
        self.prefill_s = time.perf_counter() - self.t0
        finish = "length"
        while len(self.out) < req.max_new_tokens:
            emitted = (yield from step(st, strat))[: req.max_new_tokens - len(self.out)]
            stop_at = next((i for i, t in enumerate(emitted) if t in req.stop_ids), None)
            if stop_at is not None:
                emitted = emitted[: stop_at + 1]
            st.append(emitted)
            if st.grammar is not None:
                st.grammar.consume(emitted)
            self.out += emitted
            logprobs = st.step_logprobs[:len(emitted)] if req.sampling.logprobs is not None else None
            self.out_logprobs += logprobs or []
            req.handle._tokens(Emitted(emitted, logprobs))
            if stop_at is not None:
                finish = "stop"
                break
        strat.finished(st, req.prompt, self.out)
        return self.result(finish)

    def prefill(self, runner: ModelRunner, role: str) -> Calls:
        """Commit the prompt but its last token: copied from the leader's slot (a choice of the same
        request), else the prefix store's longest stored prefix and a prefill of the rest; the prompt's
        full blocks are then stored for later requests. Returns the hidden row of the last token it
        prefilled (None: the target has none, or nothing was prefilled)."""
        prompt = list(self.request.prompt[:-1])
        source = self.leader.slot if self.leader is not None and self.leader.slot is not None else None
        source = getattr(source, role, None)
        store = (self.stores or {}).get(role)
        if source is not None and source.cache.length >= len(prompt) and prompt:
            runner.cache.load([source.cache.buf[:, :, :, :len(prompt)]])
            done = len(prompt)
        else:
            done = store.reuse(prompt, runner.cache) if store is not None else 0
        if role == "target":
            self.cached_tokens = done
        rows = yield from runner.prefill(prompt[done:])
        if store is not None:
            store.keep(prompt, runner.cache)
        return rows

    def result(self, finish: str) -> GenerationResult:
        steps = self.state.steps if self.state is not None else []
        seconds = time.perf_counter() - self.t0 if self.t0 else 0.0
        return self.request.result(finish, self.out, steps, seconds, self.prefill_s, self.cached_tokens,
                                   self.out_logprobs)


def stats(out: list[int], steps: list[StepStats], seconds: float, prefill_s: float) -> dict:
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
