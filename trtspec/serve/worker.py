"""The engine side of serving: a loaded Generator, what requests may choose on it, and one request's
choices run as a stream of plain events.

`trtspec serve` runs one Worker in its own process; with `--replicas N` (ray_serve.py) every Ray
Serve replica runs one, and the events cross the wire unchanged (tuples of plain values), so the
HTTP layer (app.py) reads the same stream either way:

    ("started", replica)                 the choices are queued on `replica` (None in a single process)
    ("piece", i, text, logprobs)         choice i's next text delta and its tokens' logprobs
    ("end", i, Outcome)                  choice i finished (jobs.Outcome)
    ("error", i, ApiError.state())       the request (i = -1: refused before it started) or choice i failed

Closing the stream early (a client gone, a Ray cancellation) cancels every choice, freeing its slot.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..runtime.generator import Generator
from ..runtime.strategies import STRATEGIES
from .jobs import follow, outcome, start
from .metrics import Metrics
from .protocol import ApiError


@dataclass
class Worker:
    gen: Generator
    strategy: str                        # for requests that name none
    allowed: tuple[str, ...] = tuple(STRATEGIES)   # strategies clients may choose
    timeout: float | None = None         # per-request deadline, seconds (a client may ask for less)
    history: str = "shared"              # suffix history: shared by all requests, per `user`, or off
    replica: str | None = None           # this worker's name among replicas (the x-trtspec-replica header)
    metrics: Metrics | None = None       # the server's, in a single process; else the worker's own
    closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics(self.gen.scheduler, len(self.gen.slots), self.gen.stores)

    @property
    def tokenizer(self):
        return self.gen.tokenizer

    @property
    def capacity(self) -> int:
        return self.gen.capacity

    def warm_up(self) -> float:
        """Run `ar` and the default strategy once (first calls pay one-off costs: ONNX Runtime's
        allocations, torch's kernels), so no client meets a cold engine; returns the seconds taken."""
        ids = self.tokenizer("Hello")["input_ids"] or [0]
        t0 = time.perf_counter()
        for strategy in dict.fromkeys(["ar", self.strategy]):
            self.gen.generate(list(ids), strategy=strategy, max_new_tokens=4)
        return time.perf_counter() - t0

    def load(self) -> dict:
        s = self.gen.scheduler
        return {"slots": len(s.slots), "active": s.busy_slots, "queued": len(s.waiting)}

    async def health(self) -> dict:
        return self.load()

    async def replica_metrics(self) -> list[tuple[str, bytes]]:
        return []                        # a single process: the server's registry is this worker's

    def close(self) -> None:
        self.closed = True
        self.gen.close()

    async def generate(self, body, prompt_ids: list[int]) -> AsyncIterator[tuple]:
        """The events of one request's `n` choices (module docstring), interleaved as they come."""
        try:
            jobs = start(self, body, prompt_ids)
        except ApiError as e:
            yield ("error", -1, e.state())
            return
        yield ("started", self.replica)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job) -> None:
            try:
                async for piece, logprobs in follow(job, self.metrics):
                    await queue.put(("piece", i, piece, logprobs))
            finally:
                queue.put_nowait(("done", i))

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            running = len(jobs)
            while running:
                event = await queue.get()
                if event[0] == "piece":
                    yield event
                    continue
                running, i = running - 1, event[1]
                try:
                    yield ("end", i, outcome(jobs[i], self.metrics))
                except ApiError as e:                # a deadline or a failure: the request ends here
                    yield ("error", i, e.state())
                    return
        finally:                                     # done, failed, or the reader left: nothing keeps running
            for task in tasks:
                task.cancel()
            for job in jobs:
                if not job.handle.done:
                    job.handle.cancel()
