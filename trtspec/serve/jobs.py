"""One HTTP generation: settle its options, submit it to the Generator, follow it as text.

`start` turns a validated body plus prompt ids into running `Job`s on a Worker (worker.py), one per
choice (or an ApiError: bad strategy or option, prompt + max_tokens over capacity, queue full).
`follow` yields the job's text as its steps arrive (stop strings cut it), records latency metrics,
and cancels the request if the caller stops early, which is how a disconnected client frees its
slot. `outcome` reads how it ended.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..errors import ConfigError, RequestError
from ..runtime.generator import room_for
from ..runtime.grammar import GrammarError
from ..runtime.kv_cache import CapacityError
from ..runtime.request import Handle
from ..runtime.sampling import SamplingParams
from ..runtime.scheduler import QueueFull
from ..runtime.strategies import STRATEGIES
from ..runtime.text import TextStream
from .protocol import ApiError, ChatRequest, Speculative, _Sampling

COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat defaults to what fits
MAX_CHOICES = 4                        # n per request: at most this many per KV slot (they queue for slots)
# Options only the server's config may set: files on the server (cascade's bigram), and what the
# suffix strategy shares between requests (its global trie's scope and memory cap: a client must not
# read another scope's history nor make the server hold new tries).
SERVER_SIDE_OPTIONS = {"bigram": "names a file on the server", "scope": "chooses whose history is shared",
                       "global_nodes": "sets the server's memory for shared history",
                       "prompts": "chooses what the server keeps of requests"}


def history_scope(history: str, user: str | None) -> str:
    """The suffix-history scope of a request: per `user` (a digest: the name is not kept; a request
    with no `user` drafts from its own tokens only), or "" with history off."""
    if history == "off" or not user:
        return ""
    return "user:" + hashlib.sha256(user.encode()).hexdigest()[:32]


@dataclass
class Job:
    handle: Handle
    text: TextStream
    strategy: str
    prompt_tokens: int
    stats: bool                          # the client asked for speculation statistics
    logprobs: int | None = None          # alternatives per token, when the client asked for logprobs
    t0: float = field(default_factory=time.perf_counter)
    first: float | None = None


def start(worker, body: _Sampling, prompt_ids: list[int]) -> list[Job]:
    """The request's `n` choices, running (one prefill: the other choices copy its prompt rows)."""
    spec = body.speculative or Speculative()
    name = spec.strategy or worker.strategy
    if name not in STRATEGIES:
        raise ApiError(400, f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}",
                       param="speculative.strategy", code="strategy_not_found")
    opts = spec.options()
    for key, why in SERVER_SIDE_OPTIONS.items():
        if key in opts:
            raise ApiError(400, f"speculative.{key} {why}; set it in the server's config",
                           param=f"speculative.{key}")
    if name not in worker.allowed:
        raise ApiError(400, f"strategy {name!r} is not enabled on this server; enabled: {', '.join(worker.allowed)}",
                       param="speculative.strategy", code="strategy_not_enabled")
    gen = worker.gen
    if worker.history != "shared" and hasattr(gen.strategy(name), "scope"):
        opts["scope"] = history_scope(worker.history, body.user)
    limits = [t for t in (body.timeout, worker.timeout) if t is not None]   # the client may only shorten it
    try:
        strat = gen.strategy(name, **opts)
        room = room_for(len(prompt_ids), strat, gen.capacity)
        default = max(1, room) if isinstance(body, ChatRequest) else COMPLETION_DEFAULT_MAX_TOKENS
        limit = body.limit() or default
        sampling = SamplingParams(
            body.temperature, max(body.top_k, 0), body.top_p, repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
            logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
            min_tokens=body.min_tokens, grammar=body.grammar(), logprobs=body.n_logprobs())
        if body.n > MAX_CHOICES * len(gen.slots):
            raise ApiError(400, f"n must be at most {MAX_CHOICES * len(gen.slots)} on this server ({len(gen.slots)} "
                                f"slots), got {body.n}", param="n")
        handles = gen.submit_choices(prompt_ids, body.n, strategy=strat, max_new_tokens=limit, sampling=sampling,
                                     seed=secrets.randbits(63) if body.seed is None else body.seed,
                                     timeout=min(limits) if limits else None, ignore_eos=body.ignore_eos,
                                     stop_token_ids=list(body.stop_token_ids or ()))
    except QueueFull as e:
        raise ApiError(429, f"server busy: {e}; retry shortly", code="queue_full", headers={"Retry-After": "1"})
    except CapacityError as e:
        raise ApiError(400, str(e).replace("max_new_tokens", "max_tokens"), param="max_tokens",
                       code="context_length_exceeded")
    except ConfigError as e:
        raise ApiError(400, str(e).replace(f"strategies.{name}.", "speculative."), param="speculative")
    except GrammarError as e:
        raise ApiError(400, str(e), param="structured_outputs" if body.structured_outputs else "response_format",
                       code="invalid_grammar")
    except RequestError as e:
        raise ApiError(400, str(e))
    worker.metrics.prompt_tokens.inc(len(prompt_ids))
    return [Job(h, TextStream(worker.tokenizer, body.stops()), name, len(prompt_ids), spec.stats, body.n_logprobs())
            for h in handles]


async def follow(job: Job, metrics) -> AsyncIterator[tuple[str, list]]:
    """(text delta, logprobs of the tokens that arrived with it) until the job ends (logprobs: [] unless
    asked for; a step's tokens may arrive before their text is final); leaving early (a client gone)
    cancels the request."""
    last = job.t0
    try:
        try:
            async for toks in job.handle:
                now = time.perf_counter()
                if job.first is None:
                    job.first = now
                    metrics.ttft.observe(now - job.t0)
                else:
                    for _ in toks:
                        metrics.itl.observe((now - last) / len(toks))
                last = now
                if job.text.stopped:
                    continue                            # the rest of a step cut by a stop string
                delta = job.text.feed(toks)
                if job.text.stopped:
                    job.handle.cancel()                 # its slot is freed within one step
                logprobs = list(toks.logprobs or ()) if job.logprobs is not None else []
                if delta or logprobs:
                    yield delta, logprobs
        except Exception:                               # noqa: BLE001 - the request failed: `outcome` says so
            return
        tail = job.text.finish()
        if tail:
            yield tail, []
    finally:
        if not job.handle.done:                         # the caller left: the client went away
            job.handle.cancel()
            metrics.finished.labels(reason="cancelled").inc()


@dataclass
class Outcome:
    finish_reason: str                   # stop | length
    completion_tokens: int
    stats: dict | None
    cached_tokens: int = 0               # prompt tokens not prefilled (prefix cache, or another choice's prefill)


def outcome(job: Job, metrics) -> Outcome:
    """How a finished job ended, recorded in the metrics; ApiError for a deadline or a failure."""
    try:
        result = job.handle.result()
    except Exception as e:                           # noqa: BLE001 - the request's own error, reported
        metrics.finished.labels(reason="error").inc()
        raise ApiError(500, f"generation failed: {type(e).__name__}: {e}", code="generation_failed") from e
    metrics.observe_steps(result.steps)
    metrics.e2e.observe(time.perf_counter() - job.t0)
    reason = "stop" if job.text.stopped else result.finish_reason
    n = len(job.text.ids) if job.text.stopped else len(result.token_ids)
    metrics.generation_tokens.inc(n)
    metrics.finished.labels(reason=reason).inc()
    if reason == "deadline":
        raise ApiError(408, f"the request's deadline passed after {n} tokens", code="deadline_exceeded")
    if reason not in ("stop", "length"):
        raise ApiError(500, f"the request ended as {reason}", code=reason)
    stats = None
    if job.stats:
        s = result.stats
        stats = {"strategy": job.strategy, "steps": s["target_steps"], "mean_accepted_length": s["mean_accepted"],
                 "draft_forwards": s["draft_forwards"], "draft_seconds": s["draft_seconds"],
                 "verify_seconds": s["verify_seconds"], "prefill_seconds": s["prefill_seconds"],
                 "mean_tree_size": s["mean_tree_size"]}
    return Outcome(reason, n, stats, result.stats.get("cached_prompt_tokens", 0))
