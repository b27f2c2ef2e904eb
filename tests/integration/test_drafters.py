"""Drafters as parts (runtime/drafters/): a drafter registered from this file alone (free, or backed
by a head role's forward) drives every strategy that grows trees from a drafter, its nodes counted
under its own name, every output equal to the target's greedy output, alone and in a batch with
other requests and drafters."""
from __future__ import annotations

import numpy as np
import pytest

from trtspec.errors import ConfigError
from trtspec.runtime.draft_model import DraftModel
from trtspec.runtime.drafters import DRAFTERS, Candidate, Drafter
from trtspec.runtime.effects import ask
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


def sources_of(gen, spec: str, refs: list[list[int]], allowed: set[str]) -> dict[str, list[int]]:
    """{drafter: [nodes proposed, accepted]} over every step of PROMPTS run with `spec`; every output
    is its greedy reference and every recorded node's source is one of `allowed`."""
    mix: dict[str, list[int]] = {}
    for prompt, ref in zip(PROMPTS, refs):
        out = gen.generate(prompt, strategy=spec, max_new_tokens=N, record_trees=True)
        assert out.token_ids == ref, spec
        for s in out.steps:
            for name, (proposed, accepted) in s.extra.get("sources", {}).items():
                mix[name] = [a + b for a, b in zip(mix.get(name, [0, 0]), (proposed, accepted))]
            names = s.extra["tree"].get("source", [])
            assert set(names) <= allowed, names
        if spec.startswith("ngram"):
            assert len(out.steps) < len(ref)                                # it sped decoding up
    return mix


@pytest.mark.parametrize("spec", SPECS)
def test_a_drafter_registered_from_a_test_file_drives_the_strategies(gen, oracle, spec):
    mix = sources_of(gen, spec, oracle, {"draft", "review", "oracle"})
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

    def names(spec, **overrides):
        strat = strategy(spec, configured, **overrides)
        assert isinstance(strat.model, DraftModel)   # both run the draft model: a part of their own
        return [d.name for d in strat.drafters]
    assert names("staged") == ["suffix"]
    assert names("staged:drafter=ngram") == ["ngram"]
    assert names("staged:drafter=oracle") == ["oracle"]
    assert names("cascade") == ["oracle"]
    assert names("cascade:suffix=true") == ["suffix"]
    assert names("staged", drafter="oracle") == ["oracle"]
    assert names("staged:drafter=[oracle,ngram]") == names("staged:drafter=oracle+ngram") == ["oracle", "ngram"]
    with pytest.raises(ConfigError) as e:
        Staged(drafter="oracle", suffix=True)
    assert "\n" not in str(e.value) and "give one" in str(e.value)
    with pytest.raises(ConfigError) as e:                # the draft model is the strategy's own part
        Staged(drafter="draft+suffix")
    assert "\n" not in str(e.value) and "'draft': the draft model is not a drafter" in str(e.value)


class Wrong(Oracle):
    """Proposes the token after each of the oracle's (never the target's), with the same high score:
    a scored drafter whose every node is rejected."""
    name = "wrong"

    def candidates(self, st, cap: int) -> tuple[int, list[Candidate]]:
        matched, cands = super().candidates(st, cap)
        return matched, [Candidate(c.parent, (c.token + 1) % 16, c.prob, c.value) for c in cands[:3]]


class Half(Oracle):
    """The oracle's chains after a context of even length only (an empty chain otherwise), unscored."""
    name = "half"
    scored = False

    def chain(self, st, context, n: int) -> list[int]:
        return super().chain(st, context, n) if len(context) % 2 == 0 else []


LISTS = ["staged:drafter=[oracle,wrong]", "staged:drafter=wrong+oracle+ngram", "staged:drafter=[ngram,oracle]",
         "staged:drafter=[half,oracle]", "cascade:drafter=half+oracle", "ngram:drafter=[half,oracle]"]


@pytest.mark.parametrize("spec", LISTS)
def test_a_strategy_grows_its_trees_from_a_list_of_drafters(gen, oracle, monkeypatch, spec):
    """`drafter: [a, b, ...]`: every scored drafter's candidates join the tree, a chain is the first
    non-empty one, each node is counted under the name of the drafter that proposed it, every output
    is the target's greedy output, and every drafter learns from finished requests."""
    monkeypatch.setitem(DRAFTERS, "wrong", Wrong)
    monkeypatch.setitem(DRAFTERS, "half", Half)
    mix = sources_of(gen, spec, oracle, {"draft", "review", "oracle", "wrong", "half", "ngram", "suffix"})
    assert mix.get("oracle", [0, 0])[0] > 0 and mix["oracle"][0] == mix["oracle"][1], (spec, mix)
    if "wrong" in spec:                                 # its own nodes, under its own name, all rejected
        assert mix.get("wrong", [0, 0])[0] > 0 and mix["wrong"][1] == 0, (spec, mix)
    if spec.startswith("ngram"):      # its chains first, the oracle's where it has none (elsewhere: reviewed)
        assert mix.get("half", [0, 0])[0] > 0 and mix["half"][0] == mix["half"][1], (spec, mix)
    assert Oracle.finished_calls == [N] * len(PROMPTS) * (1 + ("wrong" in spec) + ("half" in spec))


def test_two_drafters_candidates_merge_into_one_tree():
    """A path two drafters propose joins once, as the better candidate, and the other's children hang
    under it; parents come first, values never rise, each node keeps its drafter's tag."""
    from trtspec.runtime.drafters import merged

    class A(Drafter):
        name = "a"

    class B(Drafter):
        name = "b"
    a = [Candidate(-1, 5, 0.9, 0.9), Candidate(0, 6, 0.9, 0.8), Candidate(-1, 7, 0.3, 0.1)]
    b = [Candidate(-1, 5, 0.8, 0.7), Candidate(0, 8, 0.9, 0.6), Candidate(1, 9, 0.9, 0.5), Candidate(-1, 4, 0.5, 0.3)]
    cands, tags = merged([(A(), 4, a), (B(), 2, b)], 16)
    got = [(c.parent, c.token, c.value) for c in cands]
    assert got == [(-1, 5, 0.9), (0, 6, 0.8), (0, 8, 0.6), (2, 9, 0.5), (-1, 4, 0.3), (-1, 7, 0.1)]
    assert tags == [A().tag, A().tag, A().tag, B().tag, B().tag, B().tag, A().tag]     # the root's first
    assert [c.token for c in merged([(A(), 4, a), (B(), 2, b)], 3)[0]] == [5, 6, 8]
    assert merged([(A(), 4, a)], 16) == (a, [A().tag] * 4)               # one drafter's: as they are


def test_a_bad_list_of_drafters_is_one_line():
    for spec, words in (("staged:drafter=ngram+ngram", "named twice"), ("staged:drafter=ngram+", "list of 1 to 8"),
                        ("cascade:drafter=[]", "list of 1 to 8"), ("ngram:drafter=[ngram,3]", "list of 1 to 8"),
                        ("staged:drafter=[ngram,nope]", "unknown drafter")):
        with pytest.raises(ConfigError) as e:
            strategy(spec)
        assert "\n" not in str(e.value) and words in str(e.value) and "strategies." in str(e.value), spec


class Lookahead(Drafter):
    """A model-backed drafter registered from this file alone: before each step it asks the `medusa`
    head role for its top-1 at every depth after the root (one forward, batched with the phase's other
    requests' asks by the scheduler), and offers that path as its chain and as scored candidates."""
    name = "lookahead"
    scored = True
    reads_hidden = True
    reads_head = "medusa"
    asked: list[int] = []

    def prepare(self, st):
        st.strategy_state.pop(self.name, None)
        if st.hidden is not None:
            probs, toks = yield from ask(st.heads[self.reads_head], st.hidden[-1:], 1)
            st.strategy_state[self.name] = (st.n_tokens, [float(p[0]) for p in probs[0]], [int(t[0]) for t in toks[0]])
            self.asked.append(st.n_tokens)

    def _path(self, st):
        got = st.strategy_state.get(self.name)
        return ([], []) if got is None or got[0] != st.n_tokens else got[1:]

    def chain(self, st, context, n: int) -> list[int]:
        return self._path(st)[1][:n] if len(context) == st.n_tokens else []

    def candidates(self, st, cap: int) -> tuple[int, list[Candidate]]:
        out, value = [], 1.0
        for i, (p, tok) in enumerate(zip(*self._path(st))):
            value = st.values.child(value, p, self.tag)
            out.append(Candidate(i - 1, tok, p, value))
        return 0, out[:cap]


def test_a_model_backed_drafter_registered_from_a_test_file_drives_the_strategies(monkeypatch):
    """A drafter whose candidates cost a head role's forward is its file (here: this one) and a registry
    line: `ngram` verifies its chain, `staged` mixes its candidates with the draft's (a head's, from the
    first node), every output equals `ar`'s alone and batched, and its nodes are counted under its name."""
    from trtspec.engines.torch_engine import TorchEngine
    from trtspec.export.head import MedusaHead
    from trtspec.export.tiny import tiny_pair, tiny_spec
    from trtspec.runtime.generator import Generator
    monkeypatch.setitem(DRAFTERS, "lookahead", Lookahead)
    monkeypatch.setattr(Lookahead, "asked", [])
    target, draft = tiny_pair(tiny_spec(arch="llama"), seed=0)
    target.hidden_rows = True
    gen = Generator(TorchEngine(target), TorchEngine(draft), capacity=128,
                    heads={"medusa": MedusaHead.echo(target.lm_head.weight)})
    try:
        prompts = [[3, 17, 99, 250, 401, 7] * 2, [5, 6, 7], [9, 9, 9]]
        refs = [gen.generate(p, strategy="ar", max_new_tokens=12).token_ids for p in prompts]
        assert not Lookahead.asked                                        # ar asks no head
        for spec in ("ngram:drafter=lookahead", "staged:drafter=lookahead+ngram:budget=6"):
            handles = [gen.submit(p, strategy=spec, max_new_tokens=12, record_trees=True) for p in prompts]
            results = [h.result(timeout=120) for h in handles]
            assert [r.token_ids for r in results] == refs, spec
            nodes = sum(s.extra.get("sources", {}).get("lookahead", [0, 0])[0] for r in results for s in r.steps)
            assert nodes > 0, spec                                      # its own nodes, under its name
        assert len(Lookahead.asked) > 2 * len(prompts)                  # asked before the steps
    finally:
        gen.close()
