"""Drafters as parts (runtime/drafters/): a drafter registered from this file alone drives every
strategy that grows trees from a drafter, its nodes counted under its own name, every output
equal to the target's greedy output, alone and in a batch with other requests and drafters."""
from __future__ import annotations

import numpy as np
import pytest

from trtspec.errors import ConfigError
from trtspec.runtime.drafters import DRAFTERS, Candidate, Drafter
from trtspec.runtime.strategies import Staged, strategy

PROMPTS = ([2, 11, 2, 11, 5], [7, 3, 9], [4, 4, 8, 1, 6, 2])
N = 16


class Oracle(Drafter):
    """Knows the target's greedy continuations of PROMPTS (set by the test), and proposes them:
    a drafter of perfect guesses (scored, so tree strategies mix its candidates with the draft's)."""
    name = "oracle"
    scored = True
    known: list[list[int]] = []
    finished_calls: list[int] = []

    def chain(self, st, context, n: int) -> list[int]:
        ctx = [int(t) for t in context]
        for seq in self.known:
            if seq[: len(ctx)] == ctx:
                return seq[len(ctx): len(ctx) + n]
        return []

    def candidates(self, st, cap: int) -> tuple[int, list[Candidate]]:
        out, value = [], 1.0
        for i, tok in enumerate(self.chain(st, st.tokens(), cap)):
            value = st.values.child(value, 0.99, self.tag)
            out.append(Candidate(i - 1, tok, 0.99, value))
        return len(st.tokens()), out

    def finished(self, st, prompt: list[int], output: list[int]) -> None:
        self.finished_calls.append(len(output))


@pytest.fixture(scope="module")
def gen(small_pair):
    g = small_pair.generator(capacity=256)
    yield g
    g.close()


@pytest.fixture
def oracle(gen, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "oracle", Oracle)
    refs = [gen.generate(p, strategy="ar", max_new_tokens=N).token_ids for p in PROMPTS]
    monkeypatch.setattr(Oracle, "known", [list(p) + list(r) for p, r in zip(PROMPTS, refs)])
    monkeypatch.setattr(Oracle, "finished_calls", [])
    return refs


SPECS = ["ngram:drafter=oracle", "staged:drafter=oracle", "staged:drafter=oracle:budget=6",
         "cascade:drafter=oracle", "cascade:drafter=oracle:k_draft=2"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_drafter_registered_from_a_test_file_drives_the_strategies(gen, oracle, spec):
    mix: dict[str, list[int]] = {}
    for prompt, ref in zip(PROMPTS, oracle):
        out = gen.generate(prompt, strategy=spec, max_new_tokens=N, record_trees=True)
        assert out.token_ids == ref, spec
        for s in out.steps:
            for name, (proposed, accepted) in s.extra.get("sources", {}).items():
                mix[name] = [a + b for a, b in zip(mix.get(name, [0, 0]), (proposed, accepted))]
            names = s.extra["tree"].get("source", [])
            assert set(names) <= {"draft", "review", "oracle"}, names
        if spec.startswith("ngram"):
            assert len(out.steps) < len(ref)                                # it sped decoding up
    oracle_nodes, reviewed = mix.get("oracle", [0, 0]), mix.get("review", [0, 0])
    assert oracle_nodes[1] == oracle_nodes[0], (spec, mix)                # perfect guesses, all accepted
    assert oracle_nodes[0] > 0, (spec, mix)                               # its own nodes, under its name
    if spec.startswith("cascade"):      # and its chains, reviewed by the draft
        assert reviewed[0] > 0, (spec, mix)
    assert Oracle.finished_calls == [N] * len(PROMPTS)                      # it learns from finished requests


def test_requests_with_different_drafters_share_a_batch(gen, oracle):
    specs = ["staged:drafter=oracle", "staged", "cascade:drafter=oracle", "ngram", "ngram:drafter=oracle",
             Staged(drafter="suffix", scope="")]
    handles = [gen.submit(PROMPTS[i % len(PROMPTS)], strategy=s, max_new_tokens=N) for i, s in enumerate(specs)]
    for i, h in enumerate(handles):
        assert h.result(timeout=120).token_ids == oracle[i % len(PROMPTS)], specs[i]


def test_an_unknown_drafter_is_one_line_naming_the_option_and_the_choices():
    for spec, key in (("staged:drafter=nope", "strategies.staged.drafter"),
                      ("cascade:drafter=nope", "strategies.cascade.drafter"),
                      ("ngram:drafter=nope", "strategies.ngram.drafter")):
        with pytest.raises(ConfigError) as e:
            strategy(spec)
        msg = str(e.value)
        assert "\n" not in msg and key in msg and "ngram, suffix" in msg


def test_each_scored_drafter_calibrates_apart():
    """A drafter's scores are learned apart from the draft model's and from every other drafter's."""
    from trtspec.runtime.budget import Values
    from trtspec.runtime.proposal import DRAFT, REVIEW, tag
    values = Values()
    a, b = tag("oracle"), tag("suffix")
    assert values.of(DRAFT) is values.of(REVIEW) is values.f
    assert values.of(a) is not values.of(b) and values.of(a) is not values.f
    before = [values.of(s).tries.copy() for s in (DRAFT, a, b)]
    parents = np.array([-1, 0, 0, 1])
    values.calibrate(4, np.array([0, 1, 3]), parents, lambda: np.array([np.nan, 0.9, 0.5, 0.8]),
                     np.array([DRAFT, a, DRAFT, a]))
    after = [values.of(s).tries for s in (DRAFT, a, b)]
    assert not np.array_equal(before[0], after[0])          # node 2 (rejected) taught the draft's
    assert not np.array_equal(before[1], after[1])          # nodes 1 and 3 (accepted) taught the oracle's
    assert np.array_equal(before[2], after[2])              # the suffix tries' untouched


def test_an_override_of_the_drafter_wins_over_the_config_s_other_spelling(oracle):
    """`suffix: true` is `drafter: suffix`: a spec's override of either drops the config's other, and
    both naming different drafters in one place is one ConfigError line."""
    configured = {"staged": {"suffix": True}, "cascade": {"drafter": "oracle"}}
    assert strategy("staged", configured).drafter.name == "suffix"
    assert strategy("staged:drafter=ngram", configured).drafter.name == "ngram"
    assert strategy("staged:drafter=oracle", configured).drafter.name == "oracle"
    assert strategy("cascade", configured).drafter.name == "oracle"
    assert strategy("cascade:suffix=true", configured).drafter.name == "suffix"
    assert strategy("staged", configured, drafter="oracle").drafter.name == "oracle"
    with pytest.raises(ConfigError) as e:
        Staged(drafter="oracle", suffix=True)
    assert "\n" not in str(e.value) and "give one" in str(e.value)
