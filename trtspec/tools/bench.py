"""`trtspec bench`: our strategies against each other, Hugging Face transformers and llama.cpp.

    trtspec bench --config qwen2.5-coder-1.5b --dataset humaneval --limit 20 --max-new-tokens 128
    trtspec bench --engines engines/tiny --dataset prompts.jsonl --strategies ar,chain,ngram --peers hf
    trtspec bench --config qwen2.5-coder-1.5b-int4 --dataset humaneval --peers llama.cpp,llama.cpp-spec

What it measures, per prompt and in aggregate, for each "runner" (our strategies, then the peers:
hf_peers.py on the same weights, llamacpp_peers.py on the same GGUF files):

- tokens/s; speedup over our `ar` and over HF greedy (`hf`) on the same prompt;
- tokens per target step (tau), and its histogram from the per-step stats;
- time split: draft / verify / prefill / other (`other` = seconds - draft - verify - prefill: Python,
  tree building, draft KV commits; `overhead_fraction` = other / seconds);
- a zero-overhead ceiling (below) and measured / ceiling;
- peak memory: VmHWM of the process, reset before each run where the kernel allows
  (/proc/self/clear_refs); it is process-wide, so it includes every model loaded (ours and HF's);
  llama.cpp peers: their server process's; on CUDA also torch.cuda.max_memory_allocated per run
  (the CUDA path is untested here: no GPU);
- exact agreement of every output with our `ar` (`first_divergence` = first differing index).

Fairness: all runners produce exactly --max-new-tokens tokens (our stop ids are cleared for the
benchmark, HF's EOS is disabled, llama.cpp ignores its EOS), with the same threads; HF peers run the
same weights in the same dtype in this process, llama.cpp peers the GGUF files the folder was built
from, in a llama-server process each (see llamacpp_peers.py for what its timings mean). Runners
are interleaved per prompt (A B C A B C ...) so machine drift hits all alike; one warm-up run of
each runner (on the first prompt, at most 16 tokens) is excluded.

Ceiling. Each engine's `step` is timed (model forwards only, prefill forwards apart), so for a
strategy over N tokens in S target steps, with target forward time F_t and draft forward time F_d
(all non-prefill forwards, wherever the strategy makes them), and `ar`'s forward time per token
t_ar = F_ar / S_ar on the same prompt:

    ceiling = tau * t_ar / (t_draft_step + t_verify_step),  tau = N / S,
              t_draft_step = F_d / S, t_verify_step = F_t / S        (= N * t_ar / (F_t + F_d))

i.e. the speedup over `ar` of a runtime with no cost but model forwards (drafting by n-gram lookup
is free, prefill is ignored). `measured_over_ceiling` = measured speedup over `ar` / ceiling; `ar`
itself has ceiling 1 exactly. The measured baseline includes ar's own overhead, so a strategy whose
Python overhead per token is lower than ar's can exceed 1. The stats' draft_seconds / verify_seconds (which include some Python:
tree building, acceptance) are what the time split reports.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ..errors import RequestError
from ..runtime.prompts import Prompt, encode
from ..runtime.drafters.suffix import forget as forget_history
from .datasets import load_prompts, second_turns
from .hf_peers import PEERS as HF_PEERS
from .llamacpp_peers import PEERS as LLAMA_CPP_PEERS
from .memory import reset_peak_rss, status_mb
from .ortgenai_peers import PEERS as ORT_GENAI_PEERS

DEFAULT_STRATEGIES = "ar,chain,staged,gsd,dyspec,cascade"
DEFAULT_PEERS = "hf,hf-assisted,hf-lookup"
PEERS = {**dict.fromkeys(HF_PEERS, "hf"), **dict.fromkeys(LLAMA_CPP_PEERS, "llama.cpp"),
         **dict.fromkeys(ORT_GENAI_PEERS, "ortgenai")}   # name -> family
SUM_KEYS = ("new_tokens", "seconds", "target_steps", "draft_seconds", "verify_seconds", "prefill_seconds",
            "other_seconds", "draft_forwards", "target_forward_seconds", "draft_forward_seconds", "forward_seconds")
FORMULAS = {
    "tokens_per_s": "new_tokens / seconds (seconds include prefill)",
    "speedup_vs_ar": "tokens_per_s / tokens_per_s of our ar on the same prompt (aggregate: of the totals)",
    "speedup_vs_hf": "tokens_per_s / tokens_per_s of the hf peer (HF greedy / sampled generate)",
    "mean_accepted": "tau = new_tokens / target_steps (tokens emitted per target step; HF: per target forward)",
    "other_seconds": "seconds - draft_seconds - verify_seconds - prefill_seconds",
    "overhead_fraction": "other_seconds / seconds",
    "ceiling": "tau * t_ar / (t_draft_step + t_verify_step) = new_tokens * t_ar / (target_forward_seconds + "
               "draft_forward_seconds), t_ar = ar target_forward_seconds / ar target_steps (same prompt; "
               "aggregate: totals); model-forward time only (engine.step timed), prefill excluded",
    "measured_over_ceiling": "speedup_vs_ar / ceiling (ar's own overhead is in the measured baseline, so a "
                             "strategy with less overhead per token than ar can exceed 1)",
    "forward_fraction": "forward_seconds / seconds: share of the wall time inside model forwards (all of them, "
                        "prefill included; HF: forward hooks on the target and assistant)",
    "first_divergence": "first index where the output differs from ar's (None = identical)",
    "peak_rss_mb": "VmHWM of the whole process during the run (reset before each run when possible); "
                   "llama.cpp peers: of their server process",
}


@dataclass
class BenchOptions:
    dataset: str
    strategies: list[str] = field(default_factory=lambda: DEFAULT_STRATEGIES.split(","))
    peers: list[str] = field(default_factory=lambda: DEFAULT_PEERS.split(","))
    limit: int | None = None
    stride: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    chat: bool = False
    warmup_tokens: int = 16
    lookup_tokens: int = 10
    plan_costs: str | None = None      # a costs.json budget: auto plans with instead of the measured one
    grammar: object = None             # runtime.grammar.Grammar every run of ours is constrained by
    until_stop: bool = False           # answers end at a stop token (else exactly max_new_tokens)


def read_costs(path: str):
    """A cost table for budget: auto to plan with (bench --plan-costs): costs.json's format."""
    from ..runtime.costs import CostModel
    try:
        return CostModel.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RequestError(f"--plan-costs {path}: not a readable cost table ({e}); write it as trtspec's "
                           "costs.json (see trtspec/runtime/costs.py, or docs/bench/gpu-like-costs.json)") from None


def options_of(gen, spec: str) -> dict:
    """The options a runner ran with: the config's for its strategy, then its NAME:KEY=VALUE overrides."""
    from ..runtime.strategies import resolve
    return resolve(spec, gen.strategy_options)[1]


def parse_list(text: str | None, allowed, what: str) -> list[str]:
    items = [] if text is None or text.strip().lower() in ("", "none") else [s.strip() for s in text.split(",")]
    bad = [s for s in items if s.split(":")[0] not in allowed]     # strategies: NAME[:KEY=VALUE...]
    if bad:
        raise RequestError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(items))      # de-duplicated, order kept


# --- model-forward timing of our engines -------------------------------------------------------

def instrument(batcher):
    """Time every forward of a model (its Batcher is the only caller of engine.step_batch)."""
    batcher.timed = True
    batcher.reset_timing()
    return batcher


# --- memory and machine ------------------------------------------------------------------------

def machine_info(command: str | None = None) -> dict:
    import importlib.metadata as md

    from ..runtime.costs import cpu_name
    cpu = cpu_name()
    versions = {}
    for pkg in ("trtspec", "torch", "transformers", "numpy", "onnxruntime", "safetensors", "matplotlib"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command or _command_line(),
        "loadavg_start": load,
    }


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("trtspec", "cli.py", "__main__.py"):
        argv[0] = "trtspec"
    return shlex.join(argv)


# --- one run -----------------------------------------------------------------------------------

def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ceiling_speedup(new_tokens: int, target_fwd: float, draft_fwd: float, ar_fwd: float, ar_steps: int) -> float | None:
    """tau * t_ar / (t_draft_step + t_verify_step), which simplifies to N * t_ar / (F_t + F_d)."""
    if not new_tokens or not ar_steps or target_fwd + draft_fwd <= 0:
        return None
    return new_tokens * (ar_fwd / ar_steps) / (target_fwd + draft_fwd)


class Bench:
    """Loaded generator (+ peers), instrumented; `run(runner, ids, max_new)` -> record."""

    def __init__(self, folder: Path, opts: BenchOptions, strategy_options: dict | None = None,
                 backend: str | None = None, threads: int | None = None, config=None):
        from ..assembly.load import load_generator
        self.opts = opts
        # Requests run one after another here: one slot, so peak memory compares with the HF peers.
        # prefix cache off: every run of every runner prefills its prompt cold (the peers do too)
        self.gen = load_generator(folder, backend=backend, threads=threads, config=config, slots=1, prefix_cache=0,
                                  strategy_options=strategy_options,
                                  costs=read_costs(opts.plan_costs) if opts.plan_costs else None)
        self.stop_ids = sorted(self.gen.stop_ids)
        # every runner emits exactly max_new_tokens (requests ignore_eos), unless the answers end at a
        # stop token: asked for, or a grammar's (its output ends where the grammar does)
        self.ignore_eos = opts.grammar is None and not opts.until_stop
        self.strategies = {name: self._strategy(name) for name in opts.strategies}   # validates early
        self.timers = {role: instrument(b) for role, b in self.gen.batchers.items()}
        self.folder = folder
        self.device = str(getattr(self.gen.target_engine, "device", "cpu"))
        self.cuda = self.device.startswith("cuda")
        self.peers: dict = {}              # family -> its peers; load_peers(), once the prompts encode
        self.runners = list(opts.strategies) + list(opts.peers)
        self.max_tree = max(s.max_rows() for s in self.strategies.values())   # target tree or draft rows

    def load_peers(self, log_dir: Path) -> None:
        want = {fam: [p for p in self.opts.peers if PEERS[p] == fam] for fam in set(map(PEERS.get, self.opts.peers))}
        if "hf" in want:
            from .hf_peers import HFPeers
            self.peers["hf"] = HFPeers(self.folder, want["hf"], dtype=self.gen.target_engine.kv_dtype,
                                       lookup_tokens=self.opts.lookup_tokens, device=self.device)
        if "llama.cpp" in want:
            from .llamacpp_peers import LlamaCppPeers
            self.peers["llama.cpp"] = LlamaCppPeers(self.gen.config.to_dict(), want["llama.cpp"],
                                                    threads=torch.get_num_threads(), capacity=self.gen.capacity,
                                                    log_dir=log_dir)
        if "ortgenai" in want:
            from .ortgenai_peers import OrtGenAIPeers
            self.peers["ortgenai"] = OrtGenAIPeers(self.folder, want["ortgenai"], threads=torch.get_num_threads(),
                                                   log_dir=log_dir)

    def close(self) -> None:
        for fam in ("llama.cpp", "ortgenai"):
            if fam in self.peers:
                self.peers[fam].close()
        self.gen.close()

    def fits(self, ids: list[int]) -> bool:
        return len(ids) + self.opts.max_new_tokens + self.max_tree <= self.gen.capacity

    def _strategy(self, name: str):
        """A runner's strategy. One that learns from finished requests (suffix's global trie) learns
        only from its own runs: two variants in one bench never read each other's answers to the
        same prompt (unless the spec names a scope)."""
        strat = self.gen.strategy(name)
        if getattr(strat, "scope", "") and "scope=" not in name:
            strat = self.gen.strategy(name, scope=f"bench:{name}")
        return strat

    def run(self, runner: str, ids: list[int], max_new: int) -> dict:
        rss_before = status_mb("VmRSS")
        reset_peak_rss()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if runner in self.strategies:
            rec = self._run_ours(runner, ids, max_new)
        else:
            fam = PEERS[runner]
            tokens, stats = self.peers[fam].run(runner, ids, max_new, self.opts.temperature, self.opts.seed)
            rec = {"runner": runner, "kind": fam, **stats, "target_forward_seconds": stats["verify_seconds"],
                   "draft_forward_seconds": stats["draft_seconds"],
                   "forward_seconds": stats["verify_seconds"] + stats["draft_seconds"] + stats["prefill_seconds"],
                   "tokens_per_step_hist": {}, "token_ids": tokens}
        rec["other_seconds"] = rec["seconds"] - rec["draft_seconds"] - rec["verify_seconds"] - rec["prefill_seconds"]
        rec["overhead_fraction"] = rec["other_seconds"] / rec["seconds"] if rec["seconds"] > 0 else None
        rec["forward_fraction"] = rec["forward_seconds"] / rec["seconds"] if rec["seconds"] > 0 else None
        rec["rss_before_mb"] = rss_before
        rec.setdefault("peak_rss_mb", status_mb("VmHWM"))       # llama.cpp: its server process's
        if self.cuda:
            rec["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return rec

    def _run_ours(self, name: str, ids: list[int], max_new: int) -> dict:
        from ..runtime.sampling import SamplingParams
        for t in self.timers.values():
            t.reset_timing()
        res = self.gen.generate(ids, strategy=self.strategies[name], max_new_tokens=max_new,
                                sampling=SamplingParams(self.opts.temperature, grammar=self.opts.grammar),
                                seed=self.opts.seed, ignore_eos=self.ignore_eos)
        d = self.timers.get("draft")
        hist = Counter(s.accepted + 1 for s in res.steps)
        return {"runner": name, "kind": "trtspec", **res.stats,
                "target_forward_seconds": self.timers["target"].seconds["step"],
                "draft_forward_seconds": d.seconds["step"] if d else 0.0,
                "target_forwards": self.timers["target"].steps["step"],
                "forward_seconds": sum(sum(t.seconds.values()) for t in self.timers.values()),
                "tokens_per_step_hist": {str(k): hist[k] for k in sorted(hist)},
                "token_ids": list(res.token_ids), "sources": drafted_by(s.extra.get("sources", {}) for s in res.steps),
                **policy_steps(res.steps)}


def drafted_by(mixes) -> dict[str, list[int]]:
    """{drafter: [nodes proposed, nodes accepted]} summed over steps' (or runs') `sources` records."""
    out: dict[str, list[int]] = {}
    for mix in mixes:
        for name, (proposed, accepted) in mix.items():
            tot = out.setdefault(name, [0, 0])
            tot[0] += proposed
            tot[1] += accepted
    return out


POLICY_KEYS = ("drafted", "budget", "expected_accepted", "predicted_gain", "measured_gain", "modelled_gain",
               "modelled_s", "ar_s")


def policy_steps(steps) -> dict:
    """budget: auto's per-step record (what it chose, the gain it predicted and the one measured), as
    columns: {"policy": {"budget": [...], "accepted": [...], ...}}; {} for a fixed budget."""
    rows = [s for s in steps if "budget" in s.extra]
    if not rows:
        return {}
    cols = {k: [s.extra[k] for s in rows] for k in POLICY_KEYS}
    return {"policy": {**cols, "accepted": [s.accepted for s in rows], "tree_size": [s.tree_size for s in rows]}}


def add_comparisons(runs: dict[str, dict], temperature: float) -> None:
    """Per prompt: speedups over ar / hf, ceiling, agreement with ar (in place)."""
    ar, hf = runs.get("ar"), runs.get("hf")
    for name, r in runs.items():
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] else None
        r["speedup_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"] if hf and hf["tokens_per_s"] else None
        if r["kind"] == "trtspec" and ar:
            r["ceiling"] = ceiling_speedup(r["new_tokens"], r["target_forward_seconds"], r["draft_forward_seconds"],
                                           ar["target_forward_seconds"], ar["target_steps"])
        else:
            r["ceiling"] = None
        r["measured_over_ceiling"] = (r["speedup_vs_ar"] / r["ceiling"]
                                      if r["ceiling"] and r["speedup_vs_ar"] is not None else None)
        div = first_divergence(r["token_ids"], ar["token_ids"]) if ar else None
        r["first_divergence"] = div
        r["matches_ar"] = (div is None) if ar else None
        # Greedy: ours must match ar exactly (lossless); HF may differ by rounding (bf16) or kernels.
        # Sampled: outputs are different draws; agreement is not expected from anyone.
        r["agreement_expected"] = temperature == 0 and r["kind"] == "trtspec"


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def aggregate(records: list[dict], runners: list[str]) -> dict[str, dict]:
    """Totals over prompts (sums of the per-prompt values) and the figures derived from them."""
    out: dict[str, dict] = {}
    for name in runners:
        rs = [p["runs"][name] for p in records]
        a: dict = {"runner": name, "kind": rs[0]["kind"] if rs else None, "prompts": len(rs)}
        for k in SUM_KEYS:
            a[k] = sum(r.get(k) or 0 for r in rs)
        a["tokens_per_s"] = a["new_tokens"] / a["seconds"] if a["seconds"] > 0 else 0.0
        a["sources"] = drafted_by(r.get("sources") or {} for r in rs)
        a["mean_accepted"] = a["new_tokens"] / a["target_steps"] if a["target_steps"] else None
        a["overhead_fraction"] = a["other_seconds"] / a["seconds"] if a["seconds"] > 0 else None
        a["forward_fraction"] = a["forward_seconds"] / a["seconds"] if a["seconds"] > 0 else None
        for key in ("speedup_vs_ar", "speedup_vs_hf"):
            xs = [r[key] for r in rs if r.get(key) is not None]
            a[f"{key}_per_prompt"] = {"median": _median(xs), "geomean": _geomean(xs),
                                      "min": min(xs) if xs else None, "max": max(xs) if xs else None}
        hist: Counter = Counter()
        for r in rs:
            hist.update({int(k): v for k, v in r["tokens_per_step_hist"].items()})
        a["tokens_per_step_hist"] = {str(k): hist[k] for k in sorted(hist)}
        a["prompts_matching_ar"] = sum(1 for r in rs if r.get("matches_ar"))
        a["first_divergences"] = [r["first_divergence"] for r in rs]
        peaks = [r["peak_rss_mb"] for r in rs if r.get("peak_rss_mb") is not None]
        a["peak_rss_mb"] = max(peaks) if peaks else None
        out[name] = a
    ar, hf = out.get("ar"), out.get("hf")
    for a in out.values():
        a["speedup_vs_ar"] = a["tokens_per_s"] / ar["tokens_per_s"] if ar and ar["tokens_per_s"] else None
        a["speedup_vs_hf"] = a["tokens_per_s"] / hf["tokens_per_s"] if hf and hf["tokens_per_s"] else None
        a["ceiling"] = (ceiling_speedup(a["new_tokens"], a["target_forward_seconds"], a["draft_forward_seconds"],
                                        ar["target_forward_seconds"], ar["target_steps"])
                        if a["kind"] == "trtspec" and ar else None)
        a["measured_over_ceiling"] = (a["speedup_vs_ar"] / a["ceiling"]
                                      if a["ceiling"] and a["speedup_vs_ar"] is not None else None)
    return out


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# --- the whole benchmark -----------------------------------------------------------------------

def run_bench(folder: str | Path, opts: BenchOptions, output: str | Path, *, strategy_options: dict | None = None,
              backend: str | None = None, threads: int | None = None, command: str | None = None,
              settings: dict | None = None, log: Callable[[str], None] = print, progress: bool = True,
              config=None) -> dict:
    """Run the benchmark, write results.json / results.md / plots into `output`; return the results.
    `config`: the runtime choices to use (strategy options, draft quantization, ...), if not the
    ones recorded in the engine folder."""
    if "ar" not in opts.strategies:
        opts.strategies = ["ar"] + list(opts.strategies)    # the baseline every speedup is relative to
    folder, output = Path(folder), Path(output)
    prompts: list[Prompt] = load_prompts(opts.dataset, opts.limit, opts.stride)
    bench = Bench(folder, opts, strategy_options=strategy_options, backend=backend, threads=threads, config=config)
    tok = bench.gen.tokenizer
    prompts = with_first_answers(bench.gen, prompts, opts.max_new_tokens, set(bench.stop_ids), progress)
    encoded, skipped = [], []
    for p in prompts:
        ids = encode(p, tok, chat=opts.chat)
        if bench.fits(ids):
            encoded.append((p, ids))
        else:
            skipped.append({"id": p.id, "prompt_tokens": len(ids),
                            "reason": f"prompt + max_new_tokens + tree > KV capacity {bench.gen.capacity}"})
    if skipped:
        log(f"skipping {len(skipped)} prompt(s) too long for the KV capacity {bench.gen.capacity} "
            "(raise max_seq_len in the config)")
    if not encoded:
        raise RequestError("no prompt left to benchmark (all too long for the KV capacity); raise max_seq_len "
                           "or lower --max-new-tokens")
    try:
        return _run_loaded(bench, encoded, skipped, opts, folder, output, command, settings, progress)
    finally:
        bench.close()


def with_first_answers(gen, prompts: list[Prompt], max_new: int, stop_ids: set[int], progress: bool = True):
    """mtbench-turn2: each conversation gets the target's own answer to its first turn (greedy, by the
    config's strategy: lossless, so the answer is the target's; up to `max_new` tokens, cut at a stop
    token), not timed. Other datasets pass through."""
    strategy = getattr(gen.config, "strategy", None) or "ar"

    def answer(p: Prompt) -> str:
        ids = gen.generate(encode(p, gen.tokenizer), strategy=strategy, max_new_tokens=max_new).token_ids
        cut = next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))
        return gen.tokenizer.decode(ids[:cut], skip_special_tokens=True)
    return second_turns(prompts, answer, progress)


def _run_loaded(bench: Bench, encoded, skipped, opts: BenchOptions, folder: Path, output: Path, command, settings,
                progress: bool) -> dict:

    from tqdm import tqdm

    from .bench_report import write_report

    bench.load_peers(output / "peer-logs")

    info = machine_info(command)
    warm_tokens = min(opts.max_new_tokens, opts.warmup_tokens)
    for name in bench.runners:           # warm-up: allocators, thread pools, lazy inits; not recorded
        bench.run(name, encoded[0][1], warm_tokens)
    forget_history()                     # what the warm-up wrote must not draft the measured runs

    records = []
    output.mkdir(parents=True, exist_ok=True)
    partial = output / "partial.json"    # what a long run measured survives a crash or Ctrl-C
    bar = tqdm(total=len(encoded) * len(bench.runners), desc="bench", unit="run", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    for p, ids in encoded:
        runs = {}
        for name in bench.runners:       # interleaved: A B C ... for every prompt
            bar.set_postfix_str(f"{p.id} {name}", refresh=False)
            runs[name] = bench.run(name, ids, opts.max_new_tokens)
            bar.update()
        add_comparisons(runs, opts.temperature)
        records.append({"id": p.id, "prompt_tokens": len(ids), "chat": p.needs_chat or opts.chat,
                        "meta": p.meta, "runs": runs})
        partial.write_text(json.dumps({"machine": info, "options": asdict(opts), "prompts": records}))
    bar.close()
    partial.unlink()
    try:
        info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass

    cfg = bench.gen.config
    results = {
        "machine": info,
        "settings": {
            **asdict(opts), "engines": str(folder), "config": cfg.name, "backend": bench.gen.backend, "device": bench.device,
            "target_dtype": cfg.target.dtype, "draft_dtype": cfg.draft.dtype if cfg.draft else None,
            "target_quantize": cfg.target.quantize,
            "draft_quantize": getattr(cfg.draft, "quantize", None),   # HF's assistant is never quantized
            "kv_capacity": bench.gen.capacity, "runners": bench.runners,
            "strategy_options": {s: options_of(bench.gen, s) for s in opts.strategies},
            "stop_ids_ignored": bench.stop_ids if bench.ignore_eos else [], "warmup": f"one run per runner on the first prompt, "
                                                         f"{warm_tokens} tokens, not recorded",
            "peak_rss_reset_per_run": reset_peak_rss(),
            **{fam: peers.settings() for fam, peers in bench.peers.items()}, **(settings or {})},
        "formulas": FORMULAS,
        "prompts": records,
        "skipped": skipped,
        "aggregate": aggregate(records, bench.runners),
    }
    (output / "results.json").write_text(json.dumps(results, indent=1))
    results["files"] = ["results.json"] + write_report(results, output)
    return results


def bench_main(config_path: str | None, engines_dir: str | None, dataset: str, strategies: str, peers: str,
               limit: int | None, max_new_tokens: int, temperature: float, seed: int, chat: bool,
               output: str | None, backend: str | None, threads: int | None, lookup_tokens: int = 10,
               stride: int = 1, concurrency: str | None = None, plan_costs: str | None = None,
               shared_prefix: int | None = None, grammar: str | None = None, until_stop: bool = False,
               log: Callable[[str], None] = print, command: str | None = None) -> dict:
    """What the `trtspec bench` command does (arguments as its options)."""
    from ..assembly.cache import engines_for_config
    from ..assembly.config import Config, load_config
    from ..engines.manifest import verify
    from ..runtime.strategies import STRATEGIES
    from .bench_report import aggregate_table

    if not config_path and not engines_dir:
        raise RequestError("give --config PATH (engines are built once into the cache) and/or --engines DIR")
    opts = BenchOptions(dataset=dataset, strategies=parse_list(strategies, list(STRATEGIES), "strategy"),
                        peers=parse_list(peers, list(PEERS), "peer"), limit=limit, stride=stride,
                        max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed, chat=chat, lookup_tokens=lookup_tokens,
                        plan_costs=plan_costs, grammar=bench_grammar(grammar), until_stop=until_stop)
    if (grammar or until_stop) and opts.peers:
        raise RequestError(f"{'--grammar' if grammar else '--until-stop'} applies to our strategies only (the peers "
                           "would answer otherwise): add --peers none")
    if plan_costs:
        read_costs(plan_costs)           # a bad table fails before any engine loads
    levels = parse_levels(concurrency)
    load_prompts(dataset, 1)             # a bad dataset fails before any engine is built or loaded
    cfg = load_config(config_path) if config_path else None
    if engines_dir:
        folder = Path(engines_dir)
        built = Config.from_dict(verify(folder)["config"])
        if cfg is not None and built.digest() != cfg.with_backend(built.backend).digest():
            raise RequestError(f"{folder} was built from another config than {config_path} (models or dtypes "
                               "differ); rebuild it, or drop --config to use the folder's own")
    else:
        folder = engines_for_config(cfg, log=log, backend=backend)
    name = (cfg.name if cfg else folder.name)
    stem = Path(dataset).name.split(".")[0] if dataset.endswith((".jsonl", ".gz")) else dataset
    out = Path(output) if output else Path("out") / "bench" / f"{name}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    threads = threads if threads is not None else (cfg.threads if cfg else None)
    if levels:
        return _concurrency(folder, opts, out, levels, backend, threads, cfg, command, log)
    if shared_prefix:
        return _prefix(folder, opts, out, shared_prefix, backend, threads, cfg, command, log)
    results = run_bench(folder, opts, out, strategy_options=cfg.strategies if cfg else None, backend=backend,
                        threads=threads, command=command, log=log, config=cfg)
    log(aggregate_table(results))
    log(f"results written to {out}/ ({', '.join(results['files'])})")
    return results


def bench_grammar(text: str | None):
    """--grammar: json_object, or a JSON schema file (checked before anything loads)."""
    from ..runtime.grammar import Grammar
    if not text:
        return None
    if text == "json_object":
        return Grammar("json_object", "").check()
    try:
        return Grammar("json_schema", Path(text).read_text()).check()
    except OSError as e:
        raise RequestError(f"--grammar {text}: give json_object or a JSON schema file ({e.strerror})") from None


def parse_levels(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        levels = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise RequestError(f"--concurrency {text!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    if levels[0] < 1 or levels[-1] > 256:
        raise RequestError(f"--concurrency {text!r}: each level must be in 1..256")
    return levels


def _prefix(folder: Path, opts: BenchOptions, out: Path, tokens: int, backend, threads, cfg, command, log) -> dict:
    """`bench --shared-prefix`: see tools/bench_prefix.py."""
    from ..assembly.load import load_generator
    from .bench_prefix import prefix_bench, write_prefix_report
    prompts = load_prompts(opts.dataset, None, opts.stride)
    with load_generator(folder, backend=backend, threads=threads, config=cfg, slots=1) as gen:
        strategy = opts.strategies[0] if opts.strategies else gen.config.strategy
        records = prefix_bench(gen, prompts[:opts.limit] if opts.limit else prompts, tokens, strategy,
                               opts.max_new_tokens, opts.chat, log=log)
        settings = {"machine": machine_info(command), "engines": str(folder), "backend": gen.backend,
                    "dataset": opts.dataset, "shared_prefix": tokens, "strategy": strategy,
                    "max_new_tokens": opts.max_new_tokens, "threads": threads,
                    "title": f"{cfg.name if cfg else folder.name}: prefix cache, {opts.dataset}, a {tokens}+ token "
                             "shared block"}
    files = write_prefix_report(records, out, settings)
    log((out / "prefix.md").read_text())
    log(f"results written to {out}/ ({', '.join(files)})")
    return {"settings": settings, "records": records, "files": files}


def _concurrency(folder: Path, opts: BenchOptions, out: Path, levels: list[int], backend, threads, cfg, command,
                 log) -> dict:
    """`bench --concurrency`: see tools/bench_concurrency.py."""
    from ..assembly.load import load_generator
    with load_generator(folder, backend=backend, threads=threads, config=cfg, slots=max(levels),
                        prefix_cache=0,               # as in a cold run (the levels replay the same prompts)
                        costs=read_costs(opts.plan_costs) if opts.plan_costs else None) as gen:
        return _concurrency_loaded(gen, folder, opts, out, levels, threads, cfg, command, log)


def _concurrency_loaded(gen, folder: Path, opts: BenchOptions, out: Path, levels: list[int], threads, cfg, command,
                        log) -> dict:
    from .bench_concurrency import concurrency_bench, write_concurrency_report
    strategies = list(dict.fromkeys(["ar"] + opts.strategies))
    for s in strategies:
        gen.strategy(s)                  # validates early
    prompts = with_first_answers(gen, load_prompts(opts.dataset, opts.limit, opts.stride), opts.max_new_tokens,
                                 set(gen.stop_ids))
    prompts = [encode(p, gen.tokenizer, chat=opts.chat) for p in prompts]
    room = max(gen.strategy(s).max_rows() for s in strategies)
    prompts = [ids for ids in prompts if len(ids) + opts.max_new_tokens + room <= gen.capacity]
    if not prompts:
        raise RequestError("no prompt fits the KV capacity with --max-new-tokens; raise max_seq_len")
    records = concurrency_bench(gen, prompts, strategies, levels, opts.max_new_tokens, log=log)
    settings = {"machine": machine_info(command), "engines": str(folder), "backend": gen.backend,
                "dataset": opts.dataset, "prompts": len(prompts), "max_new_tokens": opts.max_new_tokens,
                "levels": levels, "slots": len(gen.slots), "threads": threads,
                "strategy_options": {s: options_of(gen, s) for s in strategies},
                "title": f"{cfg.name if cfg else folder.name}: {opts.dataset}, {opts.max_new_tokens} tokens"}
    files = write_concurrency_report(records, out, settings)
    log((out / "concurrency.md").read_text())
    log(f"results written to {out}/ ({', '.join(files)})")
    return {"settings": settings, "runs": records, "files": files}
