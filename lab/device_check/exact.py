"""Exactness on the device, per setting (settings.py): random-weight target/draft pairs of two
architectures, and for each setting, eager and as CUDA graphs:

- `trees`: random trees at random cached lengths, every node's logits against the same path fed
  one token per forward, bit for bit (inspect_engines.count_differences);
- `strategies`: every strategy's greedy output against `ar` under the same setting;
- `batch`: B in 1, 2, 4, 8 requests of mixed strategies at once, each against its own `ar`;
- `sampled_batch`: 8 sampled requests at once (verified in one batched walk), each against itself alone;
- `batch_rows`: the target's and the draft's logits in batches of 2, 4, 8 against each call alone,
  bit for bit (rows.py: what a sampled request's acceptance test reads), and the draft's with its
  one-row calls' logit rows padded (`fixed`); `sampled_batch_fixed_draft`: `sampled_batch` with
  that draft;
- `graphs_equal_eager`: the CUDA-graph run's tokens against the eager run's, strategy by strategy;
- `chi_square`: the first token of sampled `staged` against the target's own distribution;
- `head`: a target that returns its hidden rows (step contract v4), eager and captured as CUDA graphs
  under `fixed-fp64`, with a Medusa head role on the device (zero blocks under the target's own LM
  head: after each step it names the root): the `medusa` drafter's strategies against `ar`, alone and
  4 at once (their head forwards joined), and how often the head named the root.
"""
from __future__ import annotations

import time

import torch

from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.head import MedusaHead
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.options import MAX_STEP_TOKENS
from trtspec.runtime.generator import Generator
from trtspec.runtime.effects import drive
from trtspec.runtime.runner import ModelRunner
from trtspec.runtime.sampling import SamplingParams
from lab.chisquare import chisquare_p
from trtspec.tools.inspect_engines import TREE_ROOM, count_differences
from . import settings as S
from .rows import batch_rows
from .timing import is_cuda

ARCHS = ("llama", "qwen2")
# eager per setting, and graphs for the bucketed ones; the second architecture: the plain and exact ones
RUNS = {"llama": ("plain", "fixed", "fixed+graphs", "logical", "logical+graphs", "fixed-fp64", "fixed-fp64+graphs"),
        "qwen2": ("plain", "fixed-fp64", "fixed-fp64+graphs", "logical+graphs")}
# random trees per run, as a share of sizes()["trees"] (and of the trees' time): the product's setting
# (fixed-fp64 as graphs) and the one to replace it (logical as graphs, issue 61) get them all; a setting
# that differs shows it in a few
TREE_WEIGHT = {"plain": 0.1, "fixed": 0.1, "fixed+graphs": 0.1, "logical": 0.3, "logical+graphs": 1.0,
               "fixed-fp64": 0.3, "fixed-fp64+graphs": 1.0}
GPU_ONLY = ("logical",)      # the Triton kernel: on a CPU only the interpreter runs it (too slow at these sizes)
# Every tree fits the one 16-token step (the exact engine refuses a strategy whose steps do not).
STRATEGIES = ("chain:k=4", "ngram", "staged:budget=15:stage2=false", "dyspec:budget=15", "gsd:budget=15",
              "cascade:k_draft=4", "suffix:budget=15")


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(spec=dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
                    trees=40, longest=64, tokens=8, samples=150, prompts=(5, 17))
    return dict(spec=dict(vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2),
                trees=1000, longest=16384, tokens=48, samples=2000, prompts=(7, 200, 1500))


def pair(arch: str, tiny: bool, device: str):
    dtype = torch.bfloat16 if is_cuda(device) else torch.float32
    target, draft = tiny_pair(tiny_spec(arch, **sizes(tiny)["spec"]), seed=ARCHS.index(arch), dtype=dtype)
    return target.to(device), draft.to(device)


def prompts(vocab: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def exact(device: str, tiny: bool, deadline: float, trees: int | None = None) -> dict:
    """llama under every setting, then the chi-square and the head role, then qwen2 under the plain
    setting and the exact ones (a short lease reaches the checks the product's claims rest on)."""
    z = sizes(tiny)
    out: dict = {"settings": list(S.SETTINGS), "token_bucket": S.TOKENS, "archs": {}}
    todo = [(arch, name) for arch in ARCHS for name in RUNS[arch]]
    for i, (arch, name) in enumerate(todo):
        if i == 0 or todo[i - 1][0] != arch:
            target, draft = pair(arch, tiny, device)
            ps = prompts(target.spec.vocab_size, z["prompts"])
            capacity = max(z["longest"] + TREE_ROOM, max(z["prompts"]) + z["tokens"] + MAX_STEP_TOKENS)
            runs = out["archs"][arch] = {"model": {**z["spec"], "dtype": str(target.lm_head.weight.dtype)[6:]}}
        if time.monotonic() > deadline:
            runs[name] = {"skipped": "out of time"}
        elif name.split("+")[0] in GPU_ONLY and not is_cuda(device):
            runs[name] = {"skipped": "needs a GPU (tests/e2e/test_logical_engine.py runs it on the CPU's interpreter)"}
        else:
            setting, graphs = name.split("+")[0], name.endswith("+graphs")
            t0 = time.monotonic()
            # the trees' share of what is left: half of it, split by weight over the runs to come
            share = 0.5 * TREE_WEIGHT[name] / sum(TREE_WEIGHT[n] for _, n in todo[i:])
            n = trees if trees is not None else max(1, round(z["trees"] * TREE_WEIGHT[name]))
            with S.matmul_flags(setting):
                eng = S.engine(target, setting, device, graphs)
                try:
                    runs[name] = check(eng, draft, device, setting, ps, capacity, z, n, deadline, share)
                finally:
                    eng.close()
            eager = runs.get(setting, {}).get("outputs")
            if graphs and eager and "outputs" in runs[name]:
                runs[name]["graphs_equal_eager"] = runs[name]["outputs"] == eager
            runs[name]["seconds"] = round(time.monotonic() - t0, 1)
        if i + 1 < len(todo) and todo[i + 1][0] == arch:
            continue
        for r in runs.values():
            r.pop("outputs", None)                 # compared above; the report keeps verdicts only
        del target, draft
        if arch == ARCHS[0]:
            if time.monotonic() < deadline:
                out["chi_square"] = chi_square(device, tiny, z)
            if time.monotonic() < deadline:
                out["head"] = head_check(device, tiny, z)
    return out


def check(eng, draft, device, setting, ps, capacity, z, n: int, deadline, share: float) -> dict:
    """One setting run: `n` trees within `share` of the time left, then the outputs' checks."""
    buckets = S.buckets(setting, capacity)
    res: dict = {}
    longest = z["longest"]
    until = time.monotonic() + share * (deadline - time.monotonic())
    differ, nodes, worst, run = count_differences(eng, eng.spec.vocab_size, n, longest, seed=1,
                                                  buckets=S.buckets(setting, longest + TREE_ROOM), until=until)
    res["trees"] = {"planned": n, "run": run, "nodes": nodes, "differ": differ, "max_abs_diff": worst,
                    "longest": longest}
    # The draft as the exact generator runs it (plain), and with its one-row calls' logit rows padded
    # to the bucket too (`fixed`): on a CPU only the padded one is batch-invariant (its LM head is
    # then one GEMM shape per bucket, not a GEMV alone and a GEMM in a batch).
    drafters = {"draft": TorchEngine(draft, device)}
    if setting != "plain":
        drafters["draft, fixed rows"] = S.engine(draft, "fixed", device)
    res["batch_rows"] = {role: batch_rows(e, buckets, capacity, longest)
                         for role, e in (("target", eng), *drafters.items())}
    for e in drafters.values():
        e.close()
    if setting == "fixed-fp64":                    # that draft on sampled requests, in the product's setting
        fixed_gen = Generator(eng, S.engine(draft, "fixed", device), capacity=capacity, buckets=buckets, slots=8)
        try:
            res["sampled_batch_fixed_draft"] = sampled_batch(fixed_gen, ps, z["tokens"])
        finally:
            fixed_gen.close()
    gen = Generator(eng, TorchEngine(draft, device), capacity=capacity, buckets=buckets, slots=8)
    try:
        refs = [gen.generate(p, strategy="ar", max_new_tokens=z["tokens"]).token_ids for p in ps]
        outputs = {"ar": refs}
        wrong = []
        for s in STRATEGIES:
            if time.monotonic() > deadline:
                res["strategies_skipped"] = "out of time"
                break
            got = outputs[s] = [gen.generate(p, strategy=s, max_new_tokens=z["tokens"]).token_ids for p in ps]
            wrong += [f"{s} on prompt {i}" for i, (a, b) in enumerate(zip(got, refs)) if a != b]
        res["strategies"] = {"checked": len(outputs) - 1, "prompts": len(ps), "differ": wrong}
        res["batch"] = {}
        for b in (1, 2, 4, 8):
            jobs = [(i % len(ps), (("ar",) + STRATEGIES)[i % (len(STRATEGIES) + 1)]) for i in range(b)]
            handles = [gen.submit(ps[i], strategy=s, max_new_tokens=z["tokens"]) for i, s in jobs]
            res["batch"][b] = sum(h.result(timeout=600).token_ids != refs[i] for (i, _), h in zip(jobs, handles))
        res["sampled_batch"] = sampled_batch(gen, ps, z["tokens"])
        res["outputs"] = outputs
    finally:
        gen.close()
    return res


def sampled_batch(gen, ps, tokens: int) -> dict:
    """8 sampled requests (chains of two lengths) at once, each against its own run alone with the
    same seed: verified together in one pass, each node's token its keyed draw (verify.drawn), a
    request's tokens must not depend on its neighbours (on the device, its cumulative sums included)."""
    sp = SamplingParams(temperature=1.0)
    jobs = [(ps[i % len(ps)], "chain:k=4" if i % 2 else "chain:k=2", i) for i in range(8)]
    alone = [gen.generate(p, strategy=s, sampling=sp, seed=seed, max_new_tokens=tokens).token_ids
             for p, s, seed in jobs]
    handles = [gen.submit(p, strategy=s, sampling=sp, seed=seed, max_new_tokens=tokens) for p, s, seed in jobs]
    return {"requests": len(jobs), "differ": sum(h.result(timeout=600).token_ids != a for h, a in zip(handles, alone))}


def chi_square(device: str, tiny: bool, z: dict) -> dict:
    """Sampled `staged` (temperature 1, under `fixed`): its first tokens against the target's own
    next-token distribution after the prompt; a chi-square goodness of fit (p > 0.001 passes)."""
    target, draft = pair("llama", tiny, device)
    prompt = prompts(target.spec.vocab_size, (9,))[0]
    capacity = len(prompt) + 2 + MAX_STEP_TOKENS
    with S.matmul_flags("fixed"):
        eng = S.engine(target, "fixed", device)
        runner = ModelRunner.alone(eng, capacity, S.buckets("fixed", capacity))
        drive(runner.prefill(prompt[:-1]))
        p = torch.softmax(drive(runner.extend([prompt[-1]]))[-1].double().cpu(), -1)   # what `ar` samples from
        gen = Generator(eng, TorchEngine(draft, device), capacity=capacity, buckets=S.buckets("fixed", capacity),
                        slots=8)
        try:
            counts = torch.zeros(target.spec.vocab_size, dtype=torch.float64)
            handles = [gen.submit(prompt, strategy="staged:budget=15:stage2=false", max_new_tokens=2,
                                  sampling=SamplingParams(temperature=1.0), seed=i) for i in range(z["samples"])]
            for h in handles:
                counts[h.result(timeout=600).token_ids[0]] += 1
        finally:
            gen.close()
            eng.close()
    pvalue = chisquare_p(counts, p)
    return {"samples": z["samples"], "p_value": pvalue, "passes": pvalue > 1e-3}


HEAD_STRATEGIES = ("ngram:drafter=medusa:k=3", "staged:budget=15:stage2=false:drafter=medusa+ngram")


def head_check(device: str, tiny: bool, z: dict) -> dict:
    """The hidden rows and a head role on the device: the target's step returns its rows (eager, and
    each CUDA-graph bucket's own buffer), a zero-block Medusa head reads the last accepted row (h +
    SiLU(0) = h under the target's own LM head: the root, after each step), and the `medusa`
    drafter's strategies equal `ar`, alone and 4 requests at once."""
    target, draft = pair("llama", tiny, device)
    target.hidden_rows = True
    head = MedusaHead.echo(target.lm_head.weight).to(device)
    ps = prompts(target.spec.vocab_size, z["prompts"])
    capacity = max(z["prompts"]) + z["tokens"] + MAX_STEP_TOKENS
    out: dict = {}
    with S.matmul_flags("fixed-fp64"):
        for graphs in (False, True):
            eng = S.engine(target, "fixed-fp64", device, graphs)
            gen = Generator(eng, TorchEngine(draft, device), capacity=capacity, slots=8,
                            buckets=S.buckets("fixed-fp64", capacity), heads={"medusa": head})
            try:
                refs = [gen.generate(p, strategy="ar", max_new_tokens=z["tokens"]).token_ids for p in ps]
                wrong, named, steps = [], 0, 0
                for s in HEAD_STRATEGIES:
                    for i, p in enumerate(ps):
                        r = gen.generate(p, strategy=s, max_new_tokens=z["tokens"], record_trees=True)
                        wrong += [f"{s} on prompt {i}"] if r.token_ids != refs[i] else []
                        if s.startswith("ngram"):        # its chain's first node, after the prompt's step
                            trees = [st.extra["tree"] for st in r.steps[1:]]
                            named += sum(t["tokens"][1] == t["tokens"][0] for t in trees if len(t["tokens"]) > 1)
                            steps += len(trees)
                jobs = [(ps[i % len(ps)], HEAD_STRATEGIES[i % 2], refs[i % len(ps)]) for i in range(4)]
                handles = [gen.submit(p, strategy=s, max_new_tokens=z["tokens"]) for p, s, _ in jobs]
                batch = sum(hd.result(timeout=600).token_ids != ref for hd, (_, _, ref) in zip(handles, jobs))
                out["fixed-fp64" + ("+graphs" if graphs else "")] = {
                    "strategies_differ": wrong, "checked": len(HEAD_STRATEGIES) * len(ps), "batch4_differ": batch,
                    "root_named": f"{named} of {steps}"}
            finally:
                gen.close()
                eng.close()
    return out
