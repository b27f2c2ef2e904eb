"""The scheduler and request lifecycle: threads submitting and cancelling, a cancelled request's slot
freed within one step, deadlines, interleaved simple-API streams, async iteration, a failing request
that leaves its neighbours alone, the queue limit, one host read per target phase for the whole batch.
"""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from conftest import make_pair
from trtspec.runtime.effects import Check
from trtspec.runtime.generator import Generator
from trtspec.runtime.hooks import Hooks
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import STRATEGIES

NAMES = list(STRATEGIES)


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", vocab_size=512, num_layers=2, seed=7)


def solo(gen: Generator, prompt, n, strategy="ar", **kw):
    return gen.generate(prompt, strategy=strategy, max_new_tokens=n, **kw).token_ids


# ---------------------------------------------------------------------------------------------
# Concurrency, cancellation, deadlines
# ---------------------------------------------------------------------------------------------

def test_threads_submit_and_cancel(pair):
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=4)
    rng = random.Random(11)
    jobs = [([rng.randint(1, 400) for _ in range(rng.randint(1, 10))], rng.choice(NAMES), rng.randint(4, 24),
             rng.random() < 0.3) for _ in range(64)]
    ref = {i: solo(gen, p, n, "ar") for i, (p, _, n, _) in enumerate(jobs)}
    results: dict[int, object] = {}

    def worker(k: int) -> None:
        for i in range(k, len(jobs), 16):
            p, s, n, cancel = jobs[i]
            h = gen.submit(p, strategy=s, max_new_tokens=n)
            if cancel:
                next(iter(h), None)                  # cancel after its first step (or at once)
                h.cancel()
            results[i] = h.result(timeout=120)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == len(jobs)
    for i, r in results.items():
        if r.finish_reason == "cancelled":
            assert jobs[i][3] and r.token_ids == ref[i][: len(r.token_ids)]
        else:
            assert r.token_ids == ref[i], f"request {i} ({jobs[i][1]}) differs from its solo output"
    assert any(r.finish_reason == "cancelled" for r in results.values())
    assert gen.scheduler.busy_slots == 0 and not gen.scheduler.active and not gen.scheduler.waiting


def test_cancel_frees_the_slot_within_one_step(pair):
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=400, slots=2)
    h = gen.submit([1, 2, 3], strategy="staged", max_new_tokens=200)
    next(h)
    at = gen.scheduler.iterations
    h.cancel()
    r = h.result(timeout=30)
    assert r.finish_reason == "cancelled" and gen.scheduler.iterations - at <= 1
    assert 0 < len(r.token_ids) < 200 and gen.scheduler.busy_slots == 0


def test_deadline_ends_a_request(pair):
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=256, slots=1)
    blocker = gen.submit([1, 2, 3], strategy="chain", max_new_tokens=150)
    late = gen.submit([4, 5, 6], strategy="ar", max_new_tokens=10, timeout=0.0)   # waits for the slot
    assert late.result(timeout=30).finish_reason == "deadline"
    assert blocker.result(timeout=60).finish_reason == "length"
    assert gen.scheduler.busy_slots == 0


def test_interleaved_simple_api_streams(pair):
    gen = pair.generator(capacity=128)
    for name in NAMES:
        a_prompt, b_prompt = [3, 17, 99, 250], [7, 7, 8, 9, 100]
        want_a, want_b = solo(gen, a_prompt, 20, "ar"), solo(gen, b_prompt, 20, "ar")
        a = gen.iter_tokens(a_prompt, strategy=name, max_new_tokens=20)
        b = gen.iter_tokens(b_prompt, strategy=name, max_new_tokens=20)
        got_a, got_b = [], []
        while True:                              # alternate: one step of a, one step of b
            x, y = next(a, None), next(b, None)
            if x is None and y is None:
                break
            got_a += x or []
            got_b += y or []
        assert (got_a, got_b) == (want_a, want_b), name


def test_async_iteration(pair):
    gen = pair.generator(capacity=128)
    want = solo(gen, [5, 6, 7], 16, "chain")

    async def consume():
        h = gen.submit([5, 6, 7], strategy="chain", max_new_tokens=16)
        return [t async for toks in h for t in toks]
    assert asyncio.run(consume()) == want


def test_a_failing_request_leaves_its_neighbours_alone(pair, monkeypatch):
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=4)
    want = solo(gen, [1, 2, 3], 20, "ar")

    class Boom(Exception):
        pass

    real = STRATEGIES["ngram"].propose

    def flaky(self, st):
        if st.n_tokens > 6:
            raise Boom("a bug in one request")
        return (yield from real(self, st))
    monkeypatch.setattr(STRATEGIES["ngram"], "propose", flaky)
    bad = gen.submit([9, 9, 9, 9], strategy="ngram", max_new_tokens=20)
    good = [gen.submit([1, 2, 3], strategy=s, max_new_tokens=20) for s in ("ar", "chain", "staged")]
    with pytest.raises(Boom):
        bad.result(timeout=30)
    assert [h.result(timeout=30).token_ids for h in good] == [want] * 3
    assert gen.scheduler.busy_slots == 0


class PhaseLog(Hooks):
    """The scheduler's phases as its hooks tell them: per target phase the number of trees it ran, and
    per read that follows one the number of requests resolved together and how many were Checks."""

    def __init__(self):
        self.phases, self.transfers, self.chosen, self.target = [], [], [], False

    def phase(self, name, requests, start=True):
        if not start:
            return
        if name == "read":
            if self.target:                       # (a draft round's reads are joined too)
                self.transfers.append(len(requests))
                self.chosen.append(sum(isinstance(r.call, Check) for r in requests))
            return
        self.target = name == "target"
        if self.target:
            self.phases.append(sum(r.call.phase == "step" for r in requests))


@pytest.mark.parametrize("walk", ["cpu", "gpu"])
def test_a_target_phase_reads_the_device_once_for_the_whole_batch(pair, walk):
    """Every request whose tree a target phase verified gets its result (accepted node, next token)
    from one verification pass over all of them (verify.choose_together; `gpu`: the sampled rows in one
    batched walk, as off the CPU) and one host transfer for the whole phase (effects.resolve: one
    device sync, not one per request), whatever its strategy and sampling; each output equals the
    request's own run alone (the sampled ones draft fixed chains: with `k: auto` their trees, and so
    their draws, follow the batch). Observed through the scheduler's hooks (hooks.py)."""
    log = PhaseLog()
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=5, hooks=log,
                    batched_verify=True if walk == "gpu" else None)
    runs = [([1, 2, 3], "ar", SamplingParams()), ([4, 5, 6, 4, 5, 6], "staged", SamplingParams()),
            ([7, 8], "chain:k=3", SamplingParams(temperature=0.8)), ([9, 9, 3, 9, 9], "suffix", SamplingParams()),
            ([5, 6, 5], "chain:k=2", SamplingParams(temperature=1.0, top_k=20))]
    alone = [gen.generate(p, strategy=s, sampling=sp, seed=3, max_new_tokens=16).token_ids for p, s, sp in runs]
    log.__init__()
    handles = [gen.submit(p, strategy=s, sampling=sp, seed=3, max_new_tokens=16) for p, s, sp in runs]
    assert [h.result(timeout=60).token_ids for h in handles] == alone
    assert log.transfers == [n for n in log.phases if n]   # one transfer per phase, of every tree it verified
    assert log.chosen == log.transfers                     # each of them a Check, chosen in one pass
    assert max(log.transfers) == len(runs)                 # and all five requests shared some
    gen.close()


def test_queue_limit(pair):
    from trtspec.runtime.scheduler import QueueFull
    gen = Generator(pair.target_engine, None, capacity=256, slots=1, max_queue=1)
    first = gen.submit([1, 2], max_new_tokens=200)
    next(first)                                  # running: it holds the only slot
    second = gen.submit([1, 2], max_new_tokens=5)  # waits: the queue is full now
    with pytest.raises(QueueFull, match="max_queue 1"):
        gen.submit([1, 2], max_new_tokens=5)
    first.cancel()
    assert second.result(timeout=30).finish_reason == "length"
