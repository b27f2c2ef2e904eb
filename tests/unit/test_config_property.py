"""Property: any config is either refused at load with a ConfigError, or it builds the tiny model and
runs every strategy it names. Never another exception, never a hang.

Configs are the tiny-random config with one to three random edits: a known or random key, under any
section (top level, target, draft, their tiny shapes, build, buckets, strategies and each strategy's
options), set to a random value of a random type (None, bools, small and huge integers, floats
including nan and inf, short strings, plausible words, lists, mappings). An accepted config is
built (engines cached by digest, so runtime-only edits reuse a build) and each of its strategies
generates a few tokens; there, only the project's own errors (`TrtspecError`, e.g. `device: cuda`
on a machine without a GPU) may refuse it. Each example runs under an alarm: a hang fails the test.
"""
from __future__ import annotations

import inspect
import math
import os
import signal
from collections import Counter

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtspec.assembly.config import CONFIGS_DIR, BuildOptions, Buckets, Config, ConfigError, ModelEntry, TinyOptions
from trtspec.assembly.cache import engines_for_config
from trtspec.assembly.load import load_generator
from trtspec.errors import TrtspecError
from trtspec.runtime.generator import room_for
from trtspec.runtime.strategies import STRATEGIES

EXAMPLES = int(os.environ.get("TRTSPEC_CONFIG_EXAMPLES", "150"))
SECONDS_PER_EXAMPLE = 120     # a first ONNX export of the tiny pair takes ~10 s on 2 cores

BASE = yaml.safe_load((CONFIGS_DIR / "tiny-random.yaml").read_text())
SECTIONS: dict[str, list[str]] = {
    "": [k for k in Config.model_fields if k != "source"],
    "target": list(ModelEntry.model_fields), "draft": list(ModelEntry.model_fields),
    "target.tiny": list(TinyOptions.model_fields), "draft.tiny": list(TinyOptions.model_fields),
    "build": list(BuildOptions.model_fields), "buckets": list(Buckets.model_fields),
    "strategies": list(STRATEGIES),
    **{f"strategies.{name}": list(cls.__init__.allowed) for name, cls in STRATEGIES.items()},
}
WORDS = ["fp32", "fp16", "bf16", "int8", "none", "torch", "onnxruntime", "tensorrt", "cpu", "cuda", "heap",
         "threshold", "tiny:0", "tiny:1", "tiny:x", "pack:nope", "ar", "chain", "ngram", "staged", "dyspec",
         "gsd", "cascade", "llama", "qwen2", "mistral", "x", ""]

values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(-10**12, 10**12),
              st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0, math.nan]),
              st.text(max_size=6), st.sampled_from(WORDS)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(WORDS + ["k", "budget"]),
                                                                         inner, max_size=2)),
    max_leaves=4)


MODELS = {"": Config, "target": ModelEntry, "draft": ModelEntry, "target.tiny": TinyOptions,
          "draft.tiny": TinyOptions, "build": BuildOptions, "buckets": Buckets}


def default_of(section: str, key: str):
    """The default value of a known key (its type picks the plausible values to try)."""
    if section in MODELS and key in MODELS[section].model_fields:
        return MODELS[section].model_fields[key].get_default(call_default_factory=True)
    if section.startswith("strategies."):
        param = inspect.signature(STRATEGIES[section.split(".")[1]].__init__.__wrapped__).parameters.get(key)
        return None if param is None else param.default
    return None


def plausible(default) -> st.SearchStrategy:
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(-2, 40)
    if isinstance(default, float):
        return st.sampled_from([0.0, 0.01, 0.3, 0.9, 1.0, 1.5, 3.0, -0.1, math.nan])
    if isinstance(default, str):
        return st.sampled_from(WORDS)
    if isinstance(default, list):
        return st.lists(st.one_of(st.integers(-1, 600), st.sampled_from(WORDS)), max_size=3)
    return values


@st.composite
def edits(draw):
    out = []
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(SECTIONS)))
        known = SECTIONS[section] or ["k"]
        # Mostly known keys with plausible values (so that many configs are accepted and run), and
        # sometimes anything at all.
        key = draw(st.sampled_from(known) if draw(st.integers(0, 9)) else st.text(min_size=1, max_size=6))
        typed = plausible(default_of(section, key))
        out.append((section, key, draw(typed if draw(st.integers(0, 9)) >= 2 else values)))
    return out


def apply(edits_: list) -> dict:
    d = yaml.safe_load(yaml.safe_dump(BASE))
    for section, key, value in edits_:
        node = d
        for part in [p for p in section.split(".") if p]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[key] = value
    return d


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"one example ran over {SECONDS_PER_EXAMPLE} s")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    old = os.environ.get("TRTSPEC_CACHE")
    os.environ["TRTSPEC_CACHE"] = str(tmp_path_factory.mktemp("cfg-cache"))
    yield
    if old is None:
        os.environ.pop("TRTSPEC_CACHE", None)
    else:
        os.environ["TRTSPEC_CACHE"] = old


OUTCOMES: Counter = Counter()


def check(d: dict) -> str:
    try:
        cfg = Config.from_dict(d, source="random.yaml")
    except ConfigError as e:
        assert "\n" not in str(e)
        return "refused"
    try:
        folder = engines_for_config(cfg, log=lambda *a, **k: None)
        gen = load_generator(folder, config=cfg)
    except TrtspecError:
        return "refused at build/load"
    prompt = gen.tokenizer("def f(x):")["input_ids"]
    for name in dict.fromkeys([cfg.strategy, *cfg.strategies]):
        strat = gen.strategy(name) if not (STRATEGIES[name].needs_draft and gen.draft_engine is None) else None
        if strat is None:
            continue
        n = min(6, room_for(len(prompt), strat, gen.capacity))
        if n >= 1:
            assert len(gen.generate(prompt, strategy=name, max_new_tokens=n).token_ids) >= 1
    return "ran"


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(edits())
def _every_config_is_refused_or_works(edits_):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_EXAMPLE)
    try:
        OUTCOMES[check(apply(edits_))] += 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_the_property_sees_both_outcomes(cache):
    """The generator above is not degenerate: hand-picked edits give each outcome."""
    assert check(apply([("strategies.dyspec", "batch", 0)])) == "refused"
    assert check(apply([("strategies.dyspec", "batch", 2), ("", "strategy", "dyspec")])) == "ran"
    assert check(apply([("", "device", "cuda")])) in ("refused at build/load", "ran")


def test_random_configs_are_refused_or_work(cache):
    OUTCOMES.clear()
    _every_config_is_refused_or_works()
    print(f"[config property] outcomes: {dict(OUTCOMES)}")
    # The generator is not degenerate: its examples were neither all refused nor all accepted.
    assert OUTCOMES["refused"] >= 10 and OUTCOMES["ran"] >= 5, dict(OUTCOMES)
