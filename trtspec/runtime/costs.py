"""Measured step costs: how long one target / draft forward over N new tokens takes after C cached
(and one forward of each head role over N rows).

The adaptive budget (budget/auto.py) sizes every step's tree from these numbers, so they are measured
on the machine that runs, with the engines and threads that run:

    costs = measure(target_engine, draft_engine)          # ~20 s for the Qwen 1.5B/0.5B pair here
    costs.target(16, 300)   # seconds, interpolated: piecewise linear in N and in C, extrapolated
                            # linearly past the grid in N (never falling), past the cached grid
                            # as the one-token step grows
    costs.forward("target", [5, 1, 1], 300)   # one batched forward: 3 rows padded to 5 tokens each,
                            # from tables measured at B = 2, 4, 8 rows (linear in B between them)

A batched forward is not a single-row forward over B x T tokens: each row attends over its own
cache and is staged on its own (Qwen 1.5B fp32 here: 8 rows of one token after 512 cached cost
503 ms, one row of 8 tokens 298 ms; after 64 cached, 311 vs 323 ms), so rows are measured.

An engine folder keeps them in `costs.json`: measured by `trtspec build`, or when a generator that
runs budget: auto loads and the file is missing or was measured for another run (machine, threads,
backend, device, CUDA graphs, draft quantization, buckets: `run_key`); `trtspec inspect --engines DIR
--measure-costs` measures again. One run's table per file. It is not in the manifest's hashes: it
describes the machine, not the build.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from .effects import drive
from .runner import ModelRunner

COSTS_FILE = "costs.json"      # in an engine folder: measured on this machine, not in the manifest's hashes

TOKENS = (1, 2, 4, 8, 16, 32, 64)
CACHED = (64, 512)
ROWS = (2, 4, 8)             # batched forwards measured at these rows (B = 1 is the single-row table)
ROW_TOKENS = 16              # ... over T <= this many tokens per row (and B x T <= MAX_BATCH_TOKENS)
FORMAT = "trtspec-costs-1"


@dataclass
class CostTable:
    """Seconds of one forward: `seconds[i][j]` at `cached[i]` cached tokens and `tokens[j]` new ones."""
    tokens: list[int]
    cached: list[int]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        """ValueError unless a well-formed table (a stored costs.json is read back through here)."""
        for name, xs in (("tokens", self.tokens), ("cached", self.cached)):
            if not (isinstance(xs, list) and xs and all(type(x) is int and x >= 0 for x in xs)
                    and all(a < b for a, b in zip(xs, xs[1:]))):
                raise ValueError(f"{name} must be increasing non-negative integers")
        if not (isinstance(self.seconds, list) and len(self.seconds) == len(self.cached) and all(
                isinstance(row, list) and len(row) == len(self.tokens) and
                all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in row) for row in self.seconds)):
            raise ValueError("seconds must be a finite non-negative [cached][tokens] grid")

    def __call__(self, n: float, c: float = 0.0) -> float:
        rows = [_interp(n, self.tokens, row) for row in self.seconds]
        if c <= self.cached[-1] or len(self.cached) == 1:
            return max(_interp(c, self.cached, rows), 0.0)
        # Past the cached grid every N grows as the one-token step grows: the grid's few hundred
        # cached tokens measure each column's slope in C too noisily to continue it 10x further
        # (the target here: 2 tokens measured cheaper after 512 cached than after 64, so continued
        # column by column to 4,432 a 2-token tree cost 0.5-0.7x a one-token step, 4 tokens 3.4x),
        # while measured up to 8,160 cached the ratios T = 4, 16, 32 to T = 1 stayed within 15% of
        # those at 256.
        ones = [row[0] for row in self.seconds]
        return max(rows[-1], 0.0) * _interp(c, self.cached, ones) / max(ones[-1], 1e-12)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "cached": self.cached, "seconds": self.seconds}


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), continued linearly past both ends (one point: constant).
    Past the grid the slope is never negative: more tokens, more cache or more rows never cost less.
    (Measured tables are noisy: the draft here took 381 ms for 64 tokens after 512 cached and 466 ms
    after 64, and that falling edge, continued to a 4,432-token prompt, priced its prefill at 0 s.)"""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    slope = (y1 - y0) / (x1 - x0)
    if x < xs[0] or x > xs[-1]:          # past the grid: from its nearest end, never falling
        slope = max(slope, 0.0)
        if x > xs[-1]:
            x0, y0 = x1, y1
    return y0 + slope * (x - x0)


@dataclass
class CostModel:
    target: CostTable
    draft: CostTable | None = None
    meta: dict = field(default_factory=dict)     # threads, backend, machine, when, how
    # batched forwards: role -> {B: table over T tokens per row}; none measured = a batch costs what
    # one row over all its B x T tokens costs
    rows: dict[str, dict[int, CostTable]] = field(default_factory=dict)
    # head roles by kind: seconds of one head forward over N rows (`tokens`; no cache: cached [0])
    heads: dict[str, CostTable] = field(default_factory=dict)
    # forward() by (role, B, T, C): the policy asks for the same few shapes dozens of times a step
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def forward(self, role: str, tokens: list[int], cached: float = 0.0) -> float:
        """One forward over rows of `tokens` new tokens each, padded to the longest (the Batcher's
        shape): linear in B between the measured row counts, and past the last one."""
        if not tokens:
            return 0.0
        key = (role, len(tokens), max(tokens), cached)
        if (hit := self._memo.get(key)) is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            hit = self._memo[key] = self._forward(role, key[1], key[2], cached)
        return hit

    def _forward(self, role: str, b: int, t: int, cached: float) -> float:
        single = self.target if role == "target" else self.draft
        measured = self.rows.get(role)
        if b == 1 or not measured:
            return single(b * t, cached)
        bs = [1] + sorted(measured)
        ys = [single(t, cached)] + [measured[k](t, cached) for k in bs[1:]]
        return max(_interp(b, bs, ys), 0.0)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "meta": self.meta, "target": self.target.to_dict(),
                "draft": self.draft.to_dict() if self.draft else None,
                "rows": {role: {str(b): t.to_dict() for b, t in tables.items()} for role, tables in self.rows.items()},
                **({"heads": {kind: t.to_dict() for kind, t in self.heads.items()}} if self.heads else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        if d.get("format") != FORMAT or not isinstance(d.get("meta", {}), dict):
            raise ValueError(f"not a {FORMAT} file")
        rows = {role: {int(b): CostTable(**t) for b, t in tables.items()} for role, tables in (d.get("rows") or {}).items()}
        if any(role not in ("target", "draft") or any(b < 2 for b in t) for role, t in rows.items()):
            raise ValueError("rows are batched tables of 2 or more rows, per role")
        heads = {str(kind): CostTable(**t) for kind, t in (d.get("heads") or {}).items()}
        draft = CostTable(**d["draft"]) if d.get("draft") else None
        return cls(CostTable(**d["target"]), draft, d.get("meta", {}), rows, heads)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")    # replicas sharing a folder may store at once
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)

    def describe(self) -> list[str]:
        """Lines for `trtspec inspect`: ms per forward at each grid point."""
        m = self.meta
        out = [f"step costs ({m.get('measured', '?')}, {m.get('backend', '?')}, {m.get('threads', '?')} threads, "
               f"{m.get('machine', '?')}): ms per forward over N new tokens"]
        for role, t in (("target", self.target), ("draft", self.draft)):
            if t is None:
                continue
            for c, row in zip(t.cached, t.seconds):
                cells = "  ".join(f"{n}:{s * 1e3:.1f}" for n, s in zip(t.tokens, row))
                out.append(f"  {role:6s} C={c:<5d} N:ms  {cells}")
            for b, rt in sorted(self.rows.get(role, {}).items()):
                for c, row in zip(rt.cached, rt.seconds):
                    cells = "  ".join(f"{n}:{s * 1e3:.1f}" for n, s in zip(rt.tokens, row))
                    out.append(f"  {role:6s} C={c:<5d} B={b} rows, T per row:ms  {cells}")
        for kind, t in self.heads.items():
            cells = "  ".join(f"{n}:{s * 1e3:.2f}" for n, s in zip(t.tokens, t.seconds[0]))
            out.append(f"  {kind} head, one forward over N rows:ms  {cells}")
        return out


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cpus"


def grid(capacity: int) -> tuple[list[int], list[int]]:
    """The (tokens, cached) points that fit a cache of `capacity` rows."""
    tokens = [t for t in TOKENS if t < capacity // 2] or [1]
    cached = sorted({min(c, capacity - max(tokens) - 1) for c in CACHED if capacity - max(tokens) - 1 > 0}) or [0]
    return tokens, cached


def step_costs(runner, tokens: list[int], cached: int, repeats: int = 3, digits: int | None = 4) -> list[dict]:
    """Prefill, one warm-up forward, then `repeats` forwards per T in order: the last len(tokens) x
    repeats engine runs are the timed ones (ort_profile.op_times relies on that order)."""
    prefill_for_costs(runner, cached)
    rows = []
    for t in tokens:
        times = [timed_forward(runner, t) for _ in range(repeats)]
        rows.append(cost_row(t, times, digits))
    return rows


def prefill_for_costs(runner, cached: int) -> None:
    """`cached` tokens in the runner's cache and one warm-up forward (rolled back)."""
    runner.reset()
    vocab = runner.engine.spec.vocab_size
    drive(runner.prefill([(1000 + i) % vocab for i in range(cached)]))
    drive(runner.extend([1], last_only=False))
    runner.cache.rollback()


def timed_forward(runner, t: int) -> float:
    """Seconds of one forward over t new tokens, rolled back after."""
    vocab = runner.engine.spec.vocab_size
    t0 = time.perf_counter()
    drive(runner.extend([i % vocab for i in range(t)], last_only=False))
    dt = time.perf_counter() - t0
    runner.cache.rollback()
    return dt


def cost_row(t: int, times: list[float], digits: int | None = 4) -> dict:
    rnd = (lambda x: x) if digits is None else (lambda x: round(x, digits))
    return {"T": t, "min_s": rnd(min(times)), "median_s": rnd(sorted(times)[len(times) // 2])}


def measure_table(runner, tokens: list[int], cached: list[int], repeats: int = 3, bar=None) -> CostTable:
    """Min over `repeats` forwards per point (noise on a shared machine only adds time)."""
    rows = []
    for c in cached:
        got = step_costs(runner, tokens, c, repeats, digits=None)
        rows.append([max(r["min_s"], 1e-6) for r in got])
        if bar is not None:
            bar.update(len(tokens))
    return CostTable(list(tokens), list(cached), rows)


def measure_rows(engine, tokens: list[int], cached: list[int], rows: tuple[int, ...] = ROWS, repeats: int = 3,
                 buckets: dict | None = None, bar=None) -> dict[int, CostTable]:
    """Batched forwards as the scheduler runs them (one Batcher, one pool, B rows of T tokens, logits
    for every token): min over `repeats` per point. The caches' contents are never read for
    timing, so their rows are left as allocated (lengths set, no prefill)."""
    from .batch import MAX_BATCH_TOKENS, Batcher, Call
    capacity = max(cached) + max(tokens) + 2
    batcher = Batcher(engine, buckets, max_batch=max(rows), capacity=capacity)
    caches = engine.new_pool(max(rows), capacity + batcher.headroom).caches
    vocab = engine.spec.vocab_size
    seconds: dict[int, list[list[float]]] = {b: [] for b in rows}
    for c in cached:
        for cache in caches:
            cache.assume(c)
        for b in rows:
            line = []
            for t in tokens:
                if b * t > MAX_BATCH_TOKENS:        # the Batcher runs such calls alone
                    line.append(float("nan"))
                    continue
                ids = torch.tensor([(1000 + i) % vocab for i in range(t)], dtype=torch.int64)
                pos = torch.arange(c, c + t, dtype=torch.int64)
                mask = torch.ones(t, t, dtype=torch.bool).tril_()
                calls = [Call(batcher, caches[i], ids, pos, mask, None) for i in range(b)]
                times = []
                for _ in range(repeats + 1):         # the first: warm-up
                    t0 = time.perf_counter()
                    batcher.run(calls)
                    times.append(time.perf_counter() - t0)
                    for cache in caches[:b]:
                        cache.rollback()
                line.append(max(min(times[1:]), 1e-6))
            seconds[b].append(line)
            if bar is not None:
                bar.update(1)
    out = {}
    for b in rows:
        keep = [j for j, t in enumerate(tokens) if b * t <= MAX_BATCH_TOKENS]
        if keep:
            out[b] = CostTable([tokens[j] for j in keep], list(cached), [[line[j] for j in keep] for line in seconds[b]])
    return out


def measure_head(head, repeats: int = 3, rows: tuple[int, ...] = ROWS) -> CostTable:
    """One head forward (its top-k, as heads.run_heads asks) over 1 and `rows` rows: min over `repeats`."""
    from .heads import TOP_K
    x = torch.randn(max(rows), head.spec.hidden_size, generator=torch.Generator().manual_seed(0)).to(head.device)
    ns, seconds = [1, *rows], []
    for n in ns:
        times = []
        for _ in range(repeats + 1):                 # the first: warm-up
            t0 = time.perf_counter()
            head.top(x[:n], TOP_K)[0].cpu()           # what the phase reads back
            times.append(time.perf_counter() - t0)
        seconds.append(max(min(times[1:]), 1e-6))
    return CostTable(ns, [0], [seconds])


def run_key(threads: int = 0, backend: str = "", has_draft: bool = True, **runtime) -> dict:
    """What a table describes: this machine, threads, backend, whether a draft exists, the batch rows
    measured, and the runtime choices that change step times (device, cuda_graphs, draft_quantize,
    buckets)."""
    return {"machine": machine(), "threads": threads, "backend": backend, "draft": has_draft, "rows": list(ROWS),
            **runtime}


def measure(target, draft=None, capacity: int = 1024, threads: int = 0, backend: str = "", repeats: int = 3,
            buckets: dict | None = None, progress: bool = False, key: dict | None = None,
            heads: dict | None = None) -> CostModel:
    """Time the engines over the grid (each on a one-slot pool of its own), and each head role (by kind)."""
    from tqdm import tqdm

    tokens, cached = grid(capacity)
    if buckets and buckets.get("tokens"):              # static shapes: measure only steps that fit a bucket
        tokens = [t for t in tokens if t <= max(buckets["tokens"])] or [1]
    row_tokens = [t for t in tokens if t <= ROW_TOKENS]
    engines = [("target", target)] + ([("draft", draft)] if draft is not None else [])
    tables, rows = {}, {}
    with tqdm(total=len(engines) * len(cached) * (len(tokens) + len(ROWS)), desc="step costs", unit="point",
              disable=not progress, leave=False) as bar:
        for role, engine in engines:
            runner = ModelRunner.alone(engine, capacity=max(cached) + max(tokens) + 2, buckets=buckets)
            tables[role] = measure_table(runner, tokens, cached, repeats, bar)
            rows[role] = measure_rows(engine, row_tokens, cached, ROWS, repeats, buckets, bar)
    meta = {"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "threads": threads,
            "backend": backend, "machine": machine(), "repeats": repeats, "statistic": "min",
            "key": key or run_key(threads, backend, draft is not None)}
    return CostModel(tables["target"], tables.get("draft"), meta, rows,
                     {h.spec.kind: measure_head(h, repeats) for h in (heads or {}).values()})


def load(folder: Path) -> CostModel | None:
    try:
        return CostModel.from_dict(json.loads((Path(folder) / COSTS_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None                # unreadable or malformed: measured again (and rewritten)


def fits(costs: CostModel | None, key: dict) -> bool:
    """Whether stored costs describe this run (`run_key`)."""
    return costs is not None and costs.meta.get("key") == key


@dataclass(frozen=True)
class StoredCosts:
    """Where a run's step costs are kept (an engine folder: its costs.json) and what they must have
    been measured for (`run_key`): a loaded Generator's, read or measured at its first auto request."""
    folder: Path
    key: dict


def load_or_measure(folder: Path, target, draft, capacity: int, key: dict, buckets: dict | None = None,
                    log=None, heads: dict | None = None) -> CostModel:
    """The folder's stored costs if they describe this run (`key`), else measured now and stored."""
    costs = load(folder)
    if fits(costs, key):
        return costs
    log = log or (lambda m: print(m, file=sys.stderr))
    log(f"measuring step costs for budget: auto ({'none stored' if costs is None else 'stored ones are for another run'}"
        f"; stored in {Path(folder) / COSTS_FILE})")
    t0 = time.perf_counter()
    costs = measure(target, draft, capacity, key["threads"], key["backend"], buckets=buckets, progress=True, key=key,
                    heads=heads)
    costs.meta["seconds"] = round(time.perf_counter() - t0, 1)
    try:
        costs.save(Path(folder) / COSTS_FILE)
    except OSError:
        pass                       # a read-only folder: measured again next time
    return costs
