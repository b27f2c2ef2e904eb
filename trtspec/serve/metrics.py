"""Prometheus metrics of `trtspec serve` (prometheus-client, one registry per server).

Request and token counters, queue and slot gauges, latency histograms, and speculation counters
in the shape vLLM exports (`vllm:spec_decode_*`), under the `trtspec_` prefix:

    trtspec_spec_decode_num_drafts_total                 target steps that verified drafted tokens
    trtspec_spec_decode_num_draft_tokens_total           drafted tokens sent to the target
    trtspec_spec_decode_num_accepted_tokens_total        drafted tokens the target accepted
    trtspec_spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at depth position+1
    trtspec_spec_decode_mean_accepted_length             1 + accepted / drafts (tokens per draft step)

and the prefix cache's, as vLLM's `vllm:prefix_cache_{queries,hits}` (tokens), per model:

    trtspec_prefix_cache_queries_total{model}            prompt tokens looked up in the store
    trtspec_prefix_cache_hits_total{model}               of them, found (prefill saved)
    trtspec_prefix_cache_blocks{model}                   blocks stored now (of trtspec_prefix_cache_capacity_blocks)

and the process's own (prometheus-client's `process_resident_memory_bytes`, `process_open_fds`, ...,
and `trtspec_process_threads`), which a soak samples.

With `serve --replicas N` each replica keeps its own registry; `merge` puts them behind the
ingress's one /metrics, every sample labelled `replica` (ray_serve.py).
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def os_threads() -> int:
    """This process's threads as the OS counts them (ONNX Runtime's and torch's pools too), else Python's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return threading.active_count()


class PrefixCacheCollector:
    """The prefix stores' counters, read at scrape time (the scheduler thread keeps them)."""

    def __init__(self, stores: dict):
        self.stores = stores

    def collect(self):
        q = CounterMetricFamily("trtspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                labels=["model"])
        h = CounterMetricFamily("trtspec_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                "(prefill saved)", labels=["model"])
        b = GaugeMetricFamily("trtspec_prefix_cache_blocks", "Blocks stored in the prefix cache", labels=["model"])
        c = GaugeMetricFamily("trtspec_prefix_cache_capacity_blocks", "Blocks the prefix cache holds",
                              labels=["model"])
        for role, store in self.stores.items():
            st = store.stats()
            q.add_metric([role], st["queried_tokens"])
            h.add_metric([role], st["hit_tokens"])
            b.add_metric([role], st["blocks"])
            c.add_metric([role], st["capacity_blocks"])
        yield from (q, h, b, c)


class Metrics:
    def __init__(self, scheduler=None, slots: int = 0, stores: dict | None = None):
        """The HTTP layer's counters, and with a `scheduler` (a process that generates) the engine's."""
        self.registry = CollectorRegistry()
        self._drafts_n = self._accepted_n = 0
        ProcessCollector(registry=self.registry)                 # process_resident_memory_bytes, _open_fds, ...
        Gauge("trtspec_process_threads", "Threads of this process (the OS's count: runtime pools included)",
              registry=self.registry).set_function(os_threads)
        self.requests = Counter("trtspec_requests", "Finished HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        r = self.registry if scheduler is not None else None     # an ingress: the engine's are not exported
        if r is not None:
            r.register(PrefixCacheCollector(stores or {}))
        self.finished = Counter("trtspec_request_finish", "Generations by finish reason "
                                "(stop, length, cancelled, deadline, error)", ["reason"], registry=r)
        self.prompt_tokens = Counter("trtspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("trtspec_generation_tokens", "Generated tokens", registry=r)
        if r is not None:
            Gauge("trtspec_queue_depth", "Requests waiting for a slot", registry=r
                  ).set_function(lambda: len(scheduler.waiting))
            Gauge("trtspec_active_slots", "Slots held by running requests", registry=r
                  ).set_function(lambda: scheduler.busy_slots)
            Gauge("trtspec_slots", "KV slots (the most requests in one batch)", registry=r).set(slots)
        self.ttft = Histogram("trtspec_time_to_first_token_seconds", "Submit to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("trtspec_inter_token_latency_seconds", "Time between generated tokens (a step's "
                             "gap shared by the tokens it emitted)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("trtspec_e2e_request_latency_seconds", "Submit to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter("trtspec_spec_decode_num_drafts", "Target steps that verified drafted tokens",
                              registry=r)
        self.draft_tokens = Counter("trtspec_spec_decode_num_draft_tokens", "Drafted tokens sent to the target",
                                    registry=r)
        self.accepted = Counter("trtspec_spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.accepted_pos = Counter("trtspec_spec_decode_num_accepted_tokens_per_pos",
                                    "Drafted tokens accepted at each depth (position 0 = first drafted token)",
                                    ["position"], registry=r)
        Gauge("trtspec_spec_decode_mean_accepted_length", "Tokens emitted per target step that verified drafts "
              "(1 + accepted / drafts)", registry=r).set_function(self._mean_accepted)

    def _mean_accepted(self) -> float:
        return 1.0 + self._accepted_n / self._drafts_n if self._drafts_n else 0.0

    def observe_steps(self, steps) -> None:
        """Speculation counters from a finished request's steps (runtime StepStats)."""
        for st in steps:
            if st.tree_size <= 1:        # a plain step (ar, or a step that drafted nothing)
                continue
            self._drafts_n += 1
            self._accepted_n += st.accepted
            self.drafts.inc()
            self.draft_tokens.inc(st.tree_size - 1)
            self.accepted.inc(st.accepted)
            for pos in range(st.accepted):
                self.accepted_pos.labels(position=str(pos)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge(own: bytes, replicas: list[tuple[str, bytes]]) -> bytes:
    """One exposition of this process's metrics and each replica's, the replicas' samples labelled
    `replica` (a family declared once, whatever number of processes export it)."""
    families: dict[str, object] = {}
    for replica, text in [(None, own), *replicas]:
        for fam in text_string_to_metric_families(text.decode()):
            into = families.setdefault(fam.name, fam if replica is None else type(fam)(
                fam.name, fam.documentation, fam.type, fam.unit))
            samples = fam.samples if replica is None else [
                s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples]
            if into is fam:
                fam.samples = list(samples)
            else:
                into.samples.extend(samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
