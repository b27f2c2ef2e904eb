"""Scheduler: continuous batching of many requests over one target (and draft) model.

One thread, the only one that touches engines and KV, runs iterations:

    admit waiting requests into free slots (a request owns its slot until it ends)
    draft phase:  while any request waits on a draft call: run all of them as batched draft steps
    target phase: run every request's target call (prefill chunk, or its tree) as batched steps,
                  then every request's tree verified in one pass (verify.choose_together) and
                  the results read in one host transfer (effects.resolve)
    end cancelled / expired / finished requests and free their slots at once

Requests advance as coroutines of model calls (runner.py): each waits on exactly one call at a
time, so a phase is "collect the calls waiting on this model, run them, send each its logits".
Requests of one batch may use different strategies and sampling settings; a request joins at the
next iteration after it is submitted and leaves the moment it ends. `submit` is thread-safe.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from ..errors import RequestError
from .batch import Batcher
from .budget import BatchView
from .costs import CostModel
from .effects import EFFECTS, resolve
from .hooks import NONE, Hooks
from .request import Request, Run, Slot

LINGER = 0.05          # seconds an idle scheduler thread waits for the next request before it ends
_running: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()     # scheduler threads not yet gone
EXIT_WAIT = 30.0       # seconds interpreter exit waits for each scheduler thread to be gone


@atexit.register
def _close_running() -> None:
    """At interpreter exit, end requests still running, then wait until every scheduler thread is
    gone. A daemon thread still running once finalization starts is made to exit when it next takes
    the GIL; inside torch (which releases the GIL while freeing a tensor) that unwinds C++ frames and
    the process aborts (`terminate called without an active exception`, exit 134). A scheduler
    whose Generator was dropped is freed by its own thread on the way out (the thread held the last
    reference), so it is no longer among the running ones: its thread is waited for here."""
    for s in list(_running):
        s.close()
    for t in list(_threads):
        if t is not threading.current_thread():
            t.join(EXIT_WAIT)


class QueueFull(RequestError):
    """More requests are waiting than `max_queue` allows."""


class Scheduler:
    def __init__(self, slots: list[Slot], target: Batcher, draft: Batcher | None = None,
                 max_queue: int | None = None, hooks: Hooks | None = None, batched: bool | None = None,
                 costs: Callable[[], CostModel] | None = None, stores: dict | None = None):
        self.slots = slots
        self.costs = costs                     # the generator's step costs, for a run with budget: auto
        self.stores = stores                   # role -> PrefixStore (prefix caching), handed to each run
        self.hooks = hooks or NONE             # told of iterations, phases and the requests it resumes (hooks.py)
        self.batched = batched                 # verify.choose_together's mode (None: by the device)
        self.target, self.draft = target, draft
        self.max_queue = max_queue
        self.free: list[Slot] = list(reversed(slots))
        self.waiting: deque[Request] = deque()
        self.active: list[Run] = []            # the running requests, in the order they started
        self.runs: dict[int, Run] = {}         # the same, by request id (a choice finds its leader's)
        self.iterations = 0
        self.batch = BatchView()      # the last target phase in total, for budget: auto (budget/)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        # the last thread started, even after it cleared `_thread` on its way out: it may still be
        # dropping the last references to a batch's tensors, which must not outlive close()
        self._last: threading.Thread | None = None
        self._closed = False

    # -- any thread --------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self._cv:
            if self._closed:
                raise RequestError("this generator is closed")
            # max_queue counts requests that would wait for a slot, not those a free slot takes at once.
            if self.max_queue is not None and len(self.waiting) - len(self.free) >= self.max_queue:
                queued = len(self.waiting) - len(self.free)
                raise QueueFull(f"{queued} requests are already waiting for a slot (max_queue {self.max_queue})")
            self.waiting.append(req)
            self._cv.notify()
            if self._thread is None:
                self._thread = self._last = threading.Thread(target=self._loop, name="trtspec-scheduler", daemon=True)
                self._thread.start()
                _threads.add(self._thread)
                _running.add(self)

    def close(self) -> None:
        """Cancel everything and stop the thread: joined even when it has already left its loop, so
        that at interpreter exit no daemon thread is still freeing tensors (torch releases the GIL
        while freeing one; a daemon thread that takes it back during finalization is made to exit
        through C++ frames, and the process aborts: `terminate called without an active exception`)."""
        with self._cv:
            self._closed = True
            for req in list(self.waiting) + self.active:
                req.handle.cancel()
            self._cv.notify()
            thread = self._last
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def busy_slots(self) -> int:
        return len(self.slots) - len(self.free)

    # -- the scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        """Runs while there is work (and LINGER seconds after, for back-to-back requests); an idle
        scheduler holds no thread (`submit` starts one)."""
        try:
            while True:
                with self._cv:
                    if not (self.waiting or self.active or self._closed):
                        self._cv.wait(LINGER)
                    if not (self.waiting or self.active):
                        self._thread = None
                        return
                    self._admit()
                self.iteration()
        except BaseException as e:                   # a bug here must not leave handles waiting forever
            self._fail_all(e)
            raise

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            waiting, self.waiting = list(self.waiting), deque()
            self._thread = None
        for req in list(self.active):
            self._end(req, error=error)
        for req in waiting:
            req.handle._finish(None, error)

    def _admit(self) -> None:
        """Start waiting requests in free slots, in order; a choice whose leader has not prefilled yet
        keeps its place (requests behind it may go first)."""
        for req in list(self.waiting):
            if not self.free:
                break
            if req.handle.cancelled:
                self.waiting.remove(req)
                req.handle._finish(req.unstarted("cancelled"))
                continue
            leader = self.runs.get(req.leader.id) if req.leader is not None else None
            if req.leader is not None and not (req.leader.handle.done or (leader and leader.prefilled)):
                continue
            self.waiting.remove(req)
            auto = req.strategy.auto_nodes() is not None and self.costs is not None
            run = Run(req, self.free.pop(), self.costs() if auto else None, self.batch, self.stores, leader)
            run.coro = run.lifecycle()
            self.active.append(run)
            self.runs[run.id] = run
            self._advance(run, None)

    def iteration(self) -> None:
        """One round: every active request's draft calls, then one target phase."""
        self.hooks.iteration(True)
        try:
            self._iteration()
        finally:
            self.hooks.iteration(False)

    def _iteration(self) -> None:
        self.iterations += 1
        self._reap()
        rounds = []                                  # each draft forward's rows (tokens), for the batch view
        if self.draft is not None:
            while calls := [r for r in self.active if r.call is not None and r.call.batcher is self.draft]:
                rounds.append({r.id: len(r.call.tokens) for r in calls if r.call.phase == "step"})
                self.hooks.phase("draft", calls)
                self._run(self.draft, calls)
                self.hooks.phase("draft", calls, start=False)
                self._read()
                self._reap()
        calls = [r for r in self.active if r.call is not None and r.call.batcher is self.target]
        if calls:
            steps = [(r, len(r.call.tokens)) for r in calls if r.call.phase == "step"]
            # a request still prefilling plans its first step as its prefill returns (in _run): it and
            # its neighbours see it as a one-token row from now on, else 8 requests arriving together
            # would each plan their first step in an empty batch
            coming = [r.id for r in calls if r.call.phase != "step"]
            with self._cv:                          # and those that a free slot will take next
                coming += [r.id for r in list(self.waiting)[: len(self.free)]]
            self.batch.join(coming)
            self.hooks.phase("target", calls)
            self._run(self.target, calls)
            self.hooks.phase("target", calls, start=False)
            self._read()
            live = {r.id for r in self.active}          # a request that ended in this phase is gone
            rounds = [{i: t for i, t in rnd.items() if i in live} for rnd in rounds]
            self.batch.observe({r.id: (t, r.state.budget.expected_emitted())
                                for r, t in steps if r.id in live},
                               [rnd for rnd in rounds if rnd], [i for i in coming if i in live])
        self._reap()
        with self._cv:
            if self.waiting and self.free:
                self._admit()

    def _run(self, batcher: Batcher, reqs: list[Request]) -> None:
        """Run the requests' calls on `batcher` (batched by its groups) and advance each request.
        A batch that raises is re-run call by call, so only the request that caused it fails."""
        by_call = {id(r.call): r for r in reqs}
        for group in batcher.groups([r.call for r in reqs]):
            # on failure the batcher restores the caches
            self._together([by_call[id(c)] for c in group], batcher.run)

    def _read(self) -> None:
        """Every active request waiting on a host read or a verification (a Check) gets it: the Checks
        chosen together, everything read in one transfer (one device sync for the phase); until none
        waits (a request may read again before its next call). A transfer that raises is re-made read
        by read, so only the request that caused it fails."""
        while waiting := [r for r in self.active if isinstance(r.call, EFFECTS)]:
            self.hooks.phase("read", waiting)
            self._together(waiting, lambda effects: resolve(effects, self.batched))
            self.hooks.phase("read", waiting, start=False)

    def _together(self, reqs: list[Request], run) -> None:
        """`run` the requests' calls (or reads) together and advance each with its answer; if that
        raises, each alone, so that only the request whose call failed ends (with its error)."""
        try:
            answers = run([r.call for r in reqs])
        except Exception as e:                       # noqa: BLE001 - find whose call it was
            if len(reqs) == 1:
                self._end(reqs[0], error=e)
                return
            answers = []
            for req in reqs:
                try:
                    answers.append(run([req.call])[0])
                except Exception as e:               # noqa: BLE001 - a request's error is its own
                    answers.append(None)
                    self._end(req, error=e)
        for req, x in zip(reqs, answers):
            if x is not None:
                self._advance(req, x)

    def _advance(self, req: Run, logits) -> None:
        """Send a request its call's logits or its read's values (None: start it); it runs to its
        next call, its next read or its end."""
        self.hooks.resume(req)
        try:
            req.call = next(req.coro) if logits is None else req.coro.send(logits)
        except StopIteration as done:
            req.call = None
            self._end(req, result=done.value)
        except Exception as e:                       # noqa: BLE001 - a request's error is its own
            req.call = None
            self._end(req, error=e)
        finally:
            self.hooks.resume(None)

    def _reap(self) -> None:
        now = time.monotonic()
        with self._cv:
            gone = [r for r in self.waiting if r.handle.cancelled or (r.deadline is not None and now > r.deadline)]
            for req in gone:
                self.waiting.remove(req)
        for req in gone:
            req.handle._finish(req.unstarted("cancelled" if req.handle.cancelled else "deadline"))
        for req in list(self.active):
            if req.handle.cancelled:
                self._end(req, result=req.result("cancelled"))
            elif req.deadline is not None and now > req.deadline:
                self._end(req, result=req.result("deadline"))

    def _end(self, req: Run, result=None, error: BaseException | None = None) -> None:
        if req not in self.active:
            return
        self.active.remove(req)
        del self.runs[req.id]
        self.batch.forget(req.id)
        if req.coro is not None:
            req.coro.close()
        req.slot.reset()
        with self._cv:
            self.free.append(req.slot)
        req.slot = None
        req.handle._finish(result, error)
