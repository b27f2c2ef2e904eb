"""Batched steps over a KV pool: one batched engine step gives each row the logits it gets alone
(torch and ONNX Runtime) and writes only its own slot; requests of mixed strategies submitted together
give exactly their solo greedy output (hypothesis); sampled tokens keep the target's distribution with
neighbours in the batch (chi-square); steady state allocates nothing; a failing call fails only its
request; batch staging recopies only changed rows.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import QUIET, make_pair
from trtspec.assembly.config import CONFIGS_DIR, load_config
from trtspec.assembly.build import build_engines
from trtspec.assembly.load import load_generator
from trtspec.engines.manifest import EngineError, verify
from trtspec.engines.onnxruntime_engine import OrtEngine
from trtspec.runtime.batch import Batcher, Call
from trtspec.runtime.generator import Generator
from trtspec.runtime.strategies import STRATEGIES, ChainSpeculative, DySpec

NAMES = list(STRATEGIES) + ["staged:suffix=true", "cascade:suffix=true"]   # mixed suffix + model trees too


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", vocab_size=512, num_layers=2, seed=7)


@pytest.fixture(scope="module")
def ort_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("batching") / "ort"
    return build_engines(load_config(CONFIGS_DIR / "tiny-random.yaml"), out, backend="onnxruntime", **QUIET)


def solo(gen: Generator, prompt, n, strategy="ar", **kw):
    return gen.generate(prompt, strategy=strategy, max_new_tokens=n, **kw).token_ids


# ---------------------------------------------------------------------------------------------
# One batched engine step == each row alone
# ---------------------------------------------------------------------------------------------

def random_call(batcher, cache, gen: torch.Generator, vocab: int) -> Call:
    """A random tree of 1-7 nodes over the cache's committed rows and some scratch rows."""
    t = int(torch.randint(1, 8, (1,), generator=gen))
    s = cache.scratch
    parents = [int(torch.randint(-1, s + k, (1,), generator=gen)) if s + k > 0 else -1 for k in range(t)]
    mask = torch.zeros(t, s + t, dtype=torch.bool)
    depth = []
    for k, p in enumerate(parents):
        mask[k, s + k] = True
        node = p
        while node >= 0:
            mask[k, node] = True
            node = parents[node - s] if node >= s else -1
        depth.append(0 if p < 0 else (depth[p - s] + 1 if p >= s else 1))
    pos = torch.tensor([cache.length + d for d in depth])
    return Call(batcher, cache, torch.randint(0, vocab, (t,), generator=gen), pos, mask, None)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_batched_step_equals_each_row_alone(pair, ort_folder, backend):
    if backend == "torch":
        engine = pair.target_engine
    else:
        gen0 = load_generator(ort_folder, backend="onnxruntime")
        engine = gen0.target_engine
        assert isinstance(engine, OrtEngine)
    vocab = engine.spec.vocab_size
    batcher = Batcher(engine, max_batch=4, capacity=96)
    pools = [engine.new_pool(5, 96 + batcher.headroom) for _ in range(2)]    # batched / alone
    g = torch.Generator().manual_seed(3)
    rows = [0, 3, 4]                              # not adjacent: the batch reads separate slots
    for slot, n in zip(rows, (5, 17, 30)):        # different committed lengths
        prompt = torch.randint(0, vocab, (n,), generator=g)
        for pool in pools:
            c = pool.caches[slot]
            batcher.run([Call(batcher, c, prompt, torch.arange(n), torch.ones(n, n).tril().bool(), None)])
            c.commit(range(n))
    untouched = pools[0].buf[:, :, [1, 2]].clone()
    for step in range(4):
        calls = [random_call(batcher, pools[0].caches[s], g, vocab) for s in rows]
        twins = [Call(batcher, pools[1].caches[s], c.tokens, c.positions, c.new_mask, c.rows)
                 for s, c in zip(rows, calls)]
        together = [x.clone() for x in batcher.run(calls)]
        alone = [batcher.run([c])[0].clone() for c in twins]
        for a, b in zip(together, alone):
            torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=0)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for s in rows:
            a, b = pools[0].caches[s], pools[1].caches[s]
            assert (a.length, a.scratch) == (b.length, b.scratch)
            torch.testing.assert_close(a.buf[:, :, :, : a.used], b.buf[:, :, :, : b.used], atol=1e-5, rtol=1e-4)
        if step % 2:
            for s in rows:
                for pool in pools:
                    pool.caches[s].commit([0])
    assert torch.equal(pools[0].buf[:, :, [1, 2]], untouched), "a slot outside the batch was written"


@pytest.mark.parametrize("old", [1, 2])      # 1: no batch axis; 2: one [B, C, Hkv, D] KV tensor per layer
def test_old_contract_folder_is_refused(ort_folder, tmp_path, old):
    import shutil
    eng = tmp_path / "old"
    shutil.copytree(ort_folder, eng)
    m = json.loads((eng / "manifest.json").read_text())
    m["contract_version"] = old
    (eng / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match=f"step contract v{old}, this trtspec runs v3 and v4; rebuild it: trtspec"):
        verify(eng)


def test_contract_v3_folder_runs(ort_folder, tmp_path):
    """A v3 folder is a v4 folder without hidden rows: it runs as it is, with the same output."""
    import shutil
    eng = tmp_path / "v3"
    shutil.copytree(ort_folder, eng)
    m = json.loads((eng / "manifest.json").read_text())
    assert m["contract_version"] == 4
    assert all(o["name"] != "hidden" for model in m["models"].values() for o in model["io"]["outputs"])
    m["contract_version"] = 3
    (eng / "manifest.json").write_text(json.dumps(m))
    assert verify(eng)["contract_version"] == 3
    got = []
    for folder in (ort_folder, eng):
        gen = load_generator(folder)
        got.append(solo(gen, [5, 6, 7], 8, "chain"))
        gen.close()
    assert got[0] == got[1]


def test_older_graph_folder_runs_with_a_rebuild_hint(ort_folder, tmp_path, caplog):
    import shutil
    assert verify(ort_folder)["graph_revision"] == 2
    eng = tmp_path / "old-graph"
    shutil.copytree(ort_folder, eng)
    m = json.loads((eng / "manifest.json").read_text())
    del m["graph_revision"]             # folders built before graph revision 2 have no such key
    (eng / "manifest.json").write_text(json.dumps(m))
    with caplog.at_level("WARNING", logger="trtspec.engines.manifest"):
        verify(eng)
    assert "older graph" in caplog.text and "trtspec build" in caplog.text
    from trtspec.tools.inspect_engines import describe
    assert "graph revision 1" in describe(eng)[0] and "graph revision 2" in describe(ort_folder)[0]


# ---------------------------------------------------------------------------------------------
# Batch invariance: mixed requests together == each alone
# ---------------------------------------------------------------------------------------------

request = st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=12),   # prompt
                    st.sampled_from(NAMES), st.integers(1, 24))             # strategy, max_new_tokens


def check_batch_invariance(gen: Generator, reqs) -> None:
    ref = [solo(gen, p, n, "ar") for p, _, n in reqs]
    handles = [gen.submit(p, strategy=s, max_new_tokens=n) for p, s, n in reqs]
    got = [h.result(timeout=120) for h in handles]
    for (p, s, n), r, want in zip(reqs, got, ref):
        assert r.token_ids == want, f"{s} with prompt {p} in a batch of {len(reqs)}"
    assert gen.scheduler.busy_slots == 0


@settings(max_examples=12, deadline=None, database=None, derandomize=True)
@given(st.sampled_from([1, 2, 3, 8]).flatmap(lambda b: st.lists(request, min_size=b, max_size=b)))
def test_batch_invariance_torch(batch_gen, reqs):
    check_batch_invariance(batch_gen, reqs)


@pytest.fixture(scope="module")
def batch_gen(pair):
    stop = solo(pair.generator(capacity=128), [1, 2, 3], 12)[7]      # some requests stop early
    return Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=8, stop_ids={stop})


def test_batch_invariance_onnxruntime(ort_folder):
    gen = load_generator(ort_folder, backend="onnxruntime")
    rng = random.Random(5)
    for b in (2, 3, 8):
        reqs = [([rng.randint(1, 400) for _ in range(rng.randint(1, 12))], NAMES[i % len(NAMES)], rng.randint(1, 20))
                for i in range(b)]
        check_batch_invariance(gen, reqs)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_batch_invariance_windows_and_experts(arch_pairs, arch):
    """Gemma 3's form (a layer over a 12-key window beside a global one; prompts and outputs longer
    than the window) and Qwen3-MoE's (each row's 2 of 4 experts): mixed strategies in one batch,
    each equal to its `ar` alone."""
    pair = arch_pairs[arch]
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=8)
    rng = random.Random(6)
    try:
        for b in (3, 8):
            reqs = [([rng.randint(1, 400) for _ in range(rng.randint(5, 20))], NAMES[i % len(NAMES)],
                     rng.randint(10, 30)) for i in range(b)]
            check_batch_invariance(gen, reqs)
    finally:
        gen.close()


def test_batches_really_form(batch_gen):
    """The scheduler runs concurrent requests' calls together (fewer engine steps than alone)."""
    b = batch_gen.batchers["target"]
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    f0 = b.forwards
    for p in prompts:
        solo(batch_gen, p, 10, "ar")
    alone = b.forwards - f0
    f0 = b.forwards
    for h in [batch_gen.submit(p, strategy="ar", max_new_tokens=10) for p in prompts]:
        h.result(timeout=60)
    assert b.forwards - f0 <= alone / 3, (b.forwards - f0, alone)


# ---------------------------------------------------------------------------------------------
# Sampling with neighbours in the batch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", [ChainSpeculative(2), DySpec("heap", budget=6, batch=3)], ids=["chain", "dyspec"])
def test_sampling_exact_with_neighbours(small_pair, strategy):
    from test_sampling_exact import PASS_P, T1, exact_first_two, fit
    gen = Generator(small_pair.target_engine, small_pair.draft_engine, capacity=128, slots=3)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    joint = exact_first_two(small_pair.target, prompt, T1)
    counts = np.zeros((16, 16), dtype=np.int64)
    n = 1200
    for i in range(n):
        h = gen.submit(prompt, strategy=strategy, max_new_tokens=2, sampling=T1, seed=50_000 + i)
        # neighbours: a sampled and a greedy request of other lengths share every step
        gen.submit([5, 6, 7, 8, 9][: 1 + i % 5], strategy="ngram", max_new_tokens=3, sampling=T1, seed=i)
        gen.submit([9, 8, 7][: 1 + i % 3], strategy="staged:budget=4", max_new_tokens=2)
        counts[tuple(h.result(timeout=60).token_ids)] += 1
    p_first, p_joint = fit(counts, joint)
    print(f"[pvalue] batched {strategy.name}: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P
    assert gen.scheduler.iterations < 3 * n, "the neighbours did not share steps"


# ---------------------------------------------------------------------------------------------
# No allocation in steady state
# ---------------------------------------------------------------------------------------------

def storage(gen: Generator) -> dict:
    out = {f"pool.{r}": p.buf.data_ptr() for r, p in gen.pools.items()}
    for r, b in gen.batchers.items():
        for name in ("_mask", "_ids", "_pos", "_rows"):
            out[f"{r}.{name}"] = getattr(b, name).data_ptr()
        out[f"{r}.staging"] = (b.engine.staging._past.data_ptr(), b.engine.staging._new.data_ptr())
    out["seq"] = [s.seq.ctypes.data for s in gen.slots]
    return out


# Fixed trees: with budget auto a request's tree also depends on which neighbours share its batch at
# that moment (thread timing), so the largest batch shape, and the staging it needs, can show up late.
FIXED = ["ar", "chain:k=4", "ngram", "staged:budget=12", "dyspec:budget=12", "gsd:budget=12", "cascade:k_draft=4"]


def test_steady_state_allocates_no_step_storage(pair):
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=4)
    prompts = [[i, i + 1, i + 2, i + 5] for i in range(1, 9)]

    def wave():
        hs = [gen.submit(p, strategy=FIXED[i % len(FIXED)], max_new_tokens=24) for i, p in enumerate(prompts)]
        return [h.result(timeout=60).token_ids for h in hs]
    first = wave()                                     # warm-up: staging grows to the largest batch
    before = storage(gen)
    for _ in range(3):
        assert wave() == first
        assert storage(gen) == before


def test_generators_sharing_engines_do_not_mix(pair):
    """Two Generators (two scheduler threads) over the same engine objects: each request still gets
    exactly its solo output (the engines' step state is used by one step at a time)."""
    g1 = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=4)
    g2 = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=4)
    jobs = [([i + 1, i + 7, 3 * i + 2], NAMES[i % len(NAMES)]) for i in range(16)]
    ref = [solo(g1, p, 20, "ar") for p, _ in jobs]
    handles = [(g1 if i % 2 else g2).submit(p, strategy=s, max_new_tokens=20) for i, (p, s) in enumerate(jobs)]
    assert [h.result(timeout=120).token_ids for h in handles] == ref


def test_a_bad_token_id_is_refused_at_submit(pair):
    gen = pair.generator(capacity=64)
    from trtspec.errors import RequestError
    with pytest.raises(RequestError, match="token id 999 is outside the model's vocabulary"):
        gen.submit([1, 2, 999], max_new_tokens=4)


def test_a_failing_call_in_a_batch_fails_only_its_request(pair, monkeypatch):
    """An engine error in a batched step: the batch is re-run call by call, and only the request
    whose call raises fails."""
    gen = Generator(pair.target_engine, pair.draft_engine, capacity=128, slots=4)
    want = solo(gen, [1, 2, 3], 12, "ar")
    real = type(pair.target_engine).step_batch

    def picky(self, caches, input_ids, *rest):
        if bool((input_ids == 77).any()):
            raise RuntimeError("the engine refuses token 77")
        return real(self, caches, input_ids, *rest)
    monkeypatch.setattr(type(pair.target_engine), "step_batch", picky)
    bad = gen.submit([77, 5, 6], strategy="ar", max_new_tokens=12)
    good = [gen.submit([1, 2, 3], strategy=s, max_new_tokens=12) for s in ("ar", "ngram", "chain")]
    with pytest.raises(RuntimeError, match="token 77"):
        bad.result(timeout=30)
    assert [h.result(timeout=30).token_ids for h in good] == [want] * 3
    assert gen.scheduler.busy_slots == 0


def test_batch_staging_recopies_only_changed_rows():
    """B > 1 steps stage each row's past incrementally: committed rows are copied once, then only
    rows committed since and scratch rows; a reset slot, another layout or another order copy all."""
    from trtspec.export.spec import ModelSpec
    from trtspec.runtime.kv_cache import BatchStaging, KVPool
    spec = ModelSpec(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
    torch.manual_seed(0)
    pool = KVPool(spec, slots=3, capacity=200, dtype=torch.float32)
    pool.buf.normal_()
    caches = pool.caches
    for cache, n in zip(caches, (50, 70, 30)):
        cache.length = n
    st = BatchStaging(spec, torch.float32, "cpu")

    def past(cs, c):
        st.copied_rows = 0
        out = st.past(cs, c)
        for b, cache in enumerate(cs):     # every row's written rows, whatever was copied
            assert torch.equal(out[:, b, :cache.used], torch.stack([blk[:cache.used] for blk in cache.blocks]))
        return st.copied_rows

    def step(cs, t):                       # what an engine does after its run
        st.scatter(cs, torch.randn(2 * spec.num_layers * 2, len(cs), t, 16))
        for cache in cs:
            cache.advance(t)

    assert past(caches, 128) == 150
    step(caches, 3)
    assert past(caches, 128) == 9          # scratch rows only
    step(caches, 3)
    caches[0].commit([1, 4])               # a non-prefix path: rows move within the slot
    caches[1].commit([0, 1, 2])
    caches[2].rollback()
    assert past(caches, 128) == 2 + 3 + 0
    caches[2].reset()                      # the slot goes to a new request
    pool.buf[:, :, 2, :, :10].normal_()
    caches[2].length = 10
    assert past(caches, 128) == 10
    assert past(caches, 192) == 52 + 73 + 10                     # another layout
    assert past(caches[::-1], 192) == 10 + 52                    # rows 0 and 2 swap; row 1 stays put
    other = KVPool(spec, slots=3, capacity=200, dtype=torch.float32).caches
    for cache, mine in zip(other, caches[::-1]):
        cache.length = mine.length
    assert past(other, 192) == 52 + 73 + 10                      # same shape, other caches
