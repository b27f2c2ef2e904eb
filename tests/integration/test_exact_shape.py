"""A GPU target exact by one step shape (engines/exact.py), its plumbing checked on the CPU: the
config gives a `device: cuda` torch target one token and one cache bucket and refuses, in one line,
strategies whose steps do not fit; the loader builds that target with fp64 attention, padded logit
rows and the cuBLAS flags; its generator refuses a larger strategy at request time and keeps a
grammar's jump-forward within the step; every strategy that fits equals `ar`. That the construction
is exact on a GPU is measured by the device check (docs/gpu.md), which builds the same engine."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_dict
from trtspec.assembly.backends import LoadOptions
from trtspec.assembly.load import load_engine
from trtspec.assembly.config import Config
from trtspec.engines.exact import TOKENS, exact_engine
from trtspec.engines.manifest import verify
from trtspec.engines.torch_engine import TorchEngine
from trtspec.errors import ConfigError, RequestError
from trtspec.runtime.generator import Generator
from trtspec.runtime.sampling import SamplingParams

FITS = ("ar", "chain:k=4", "ngram", "staged:budget=15:stage2=false", "dyspec:budget=15", "suffix:budget=15")


def cfg(**kw) -> Config:
    return Config.from_dict({**tiny_dict(), **kw}, source="c.yaml")


def test_a_gpu_target_gets_one_step_shape_and_refuses_what_does_not_fit():
    c = cfg(device="cuda", strategy="chain")
    assert c.exact and c.step_buckets() == {"tokens": [TOKENS], "cache": [c.max_seq_len]} and c.max_step() == TOKENS
    assert cfg(device="cuda", strategy="chain", buckets={"tokens": [32]}).max_step() == 32
    logical = cfg(device="cuda", strategy="chain", exactness="logical")     # the same shape, attention by logical order
    assert logical.exact and logical.step_buckets() == c.step_buckets()
    plain = cfg(device="cuda", strategy="staged", exactness="plain")        # the opt-out: shapes as they come
    assert not plain.exact and plain.step_buckets() == {"tokens": [], "cache": []}
    assert not cfg(strategy="staged").exact                                   # a CPU target: unchanged
    assert cfg(device="cuda").digest() == cfg().digest() == cfg(exactness="plain").digest()   # a runtime choice
    with pytest.raises(ConfigError) as e:
        cfg(device="cuda", strategy="staged")
    msg = str(e.value)
    assert "\n" not in msg and "strategies.staged: one step can send" in msg and "16-token shape" in msg
    assert "stage2: false" in msg and "exactness: plain" in msg
    with pytest.raises(ConfigError, match="give buckets.tokens and buckets.cache one size each"):
        cfg(device="cuda", strategy="chain", buckets={"tokens": [8, 16]})


@pytest.fixture(scope="module")
def exact_gen(llama_pair):
    target = exact_engine(lambda m: TorchEngine(m), copy.deepcopy(llama_pair.target))
    g = Generator(target, llama_pair.draft_engine, capacity=256, buckets={"tokens": [TOKENS], "cache": [256]})
    yield g
    g.close()


def test_every_strategy_that_fits_equals_ar_and_a_larger_one_is_refused(llama_gen, exact_gen):
    assert exact_gen.target_engine.kv_dtype == torch.float64 and exact_gen.target_engine.fixed_rows
    assert exact_gen.batchers["target"].max_step == TOKENS and llama_gen.batchers["target"].max_step > TOKENS
    prompt = [3, 17, 99, 250, 401, 7, 3, 17, 99, 250, 401, 7, 3, 17]
    ref = exact_gen.generate(prompt, strategy="ar", max_new_tokens=24)
    for name in FITS[1:]:
        r = exact_gen.generate(prompt, strategy=name, max_new_tokens=24, record_trees=True)
        assert r.token_ids == ref.token_ids, name
        assert max(len(s.extra["tree"]["tokens"]) for s in r.steps[1:]) <= TOKENS, name
    with pytest.raises(RequestError) as e:
        exact_gen.submit(prompt, strategy="staged", max_new_tokens=4)
    assert "more than the 16 a step allows on this target (exact on the GPU" in str(e.value)
    llama_gen.submit(prompt, strategy="staged", max_new_tokens=4).result(timeout=60)     # a CPU target takes it


def test_a_grammars_forced_tokens_stay_within_the_step(exact_gen, monkeypatch):
    """Jump-forward adds up to 16 forced tokens to a tree; on an exact target only up to its step."""
    from test_logit_rules import GRAMMARS, ROOT
    from trtspec.export.tokenizer import load_tokenizer
    tok = load_tokenizer(ROOT / "trtspec" / "assets" / "tiny-tokenizer")
    g = Generator(exact_gen.target_engine, exact_gen.draft_engine, capacity=256, tokenizer=tok, stop_ids={0},
                  buckets={"tokens": [TOKENS], "cache": [256]})
    try:
        prompt = tok.encode("hello world, the answer is")
        sp = SamplingParams(grammar=GRAMMARS[1])
        ref = g.generate(prompt, strategy="ar", max_new_tokens=48, sampling=sp)
        name = "dyspec:budget=15"

        def tree_sizes():
            r = g.generate(prompt, strategy=name, max_new_tokens=48, sampling=sp, record_trees=True)
            assert r.token_ids == ref.token_ids
            assert sum(s.extra.get("forced", 0) for s in r.steps) > 0
            return [len(s.extra["tree"]["tokens"]) for s in r.steps[1:]]

        assert max(tree_sizes()) <= TOKENS
        monkeypatch.setattr(g.batchers["target"], "max_step", 256)     # what the cap prevents
        assert max(tree_sizes()) > TOKENS
    finally:
        g.close()


def test_the_loader_builds_the_exact_target(torch_folder):
    m = verify(torch_folder)
    info = m["models"]["target"]
    eng = load_engine(torch_folder, "target", info, "torch", LoadOptions(device="cpu", exact="fixed-fp64"))
    logical = load_engine(torch_folder, "target", info, "torch", LoadOptions(device="cpu", exact="logical"))
    plain = load_engine(torch_folder, "target", info, "torch", LoadOptions(device="cpu"))
    try:
        assert eng.exact and eng.fixed_rows and eng.kv_dtype == torch.float64
        assert type(logical).__name__ == "LogicalTorchEngine" and logical.exact and logical.fixed_rows
        assert logical.kv_dtype == plain.kv_dtype != torch.float64        # the model's own dtype
        assert not plain.exact and not getattr(plain, "fixed_rows", False) and plain.kv_dtype != torch.float64
    finally:
        for e in (eng, logical, plain):
            e.close()
