"""Production sampling under speculation (issue 28): penalties, logit_bias, min_tokens, stop_token_ids,
grammars (structured outputs) and logprobs, exact for every strategy.

- Greedy: every registered strategy emits exactly `ar`'s tokens under the same rules (hypothesis
  draws the rules and prompts), and `ar` under the rules equals an independent cache-free reference
  (penalties written here again, in numpy, from vLLM's definitions). The rules really change the
  output (checked), so equality is not vacuous.
- Sampled: the joint distribution of the first two tokens under penalties + logit_bias, and under a
  grammar, equals the exact one (chi-square), for a sampled chain and a tree strategy.
- Grammars: every strategy's greedy output equals constrained `ar`'s, forbidden drafts are pruned
  (it happens), the draft model's own proposals are masked (fewer pruned, more accepted), finished
  outputs match the regex / validate against the JSON schema.
- logprobs: every strategy reports `ar`'s values for the same tokens (fp32 tolerance), and `ar`'s
  are the log-softmax of the cache-free reference logits.
- Batch invariance: requests with different rules sharing batches each get their solo output.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_pair, reference_logits
from hypothesis import given, settings
from hypothesis import strategies as hst
from test_sampling_exact import PASS_P, chisquare_p, reference_probs, sample_first

from trtspec.errors import RequestError
from trtspec.export.tokenizer import load_tokenizer
from trtspec.runtime.decode import DecodeState
from trtspec.runtime.grammar import Grammar
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import STRATEGIES, ChainSpeculative, Staged

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[3, 17, 99, 250, 401, 7, 3, 17, 99, 250, 401, 7, 3, 17], [5, 5, 5, 5, 9], [42]]
SETTINGS = settings(max_examples=6, deadline=None, database=None)


def reference_shape(logits: np.ndarray, prompt: list[int], out: list[int], sp: SamplingParams,
                    stop_ids=()) -> np.ndarray:
    """vLLM's penalties, logit_bias and min_tokens on one position's logits, in float64 numpy."""
    x = logits.astype(np.float64).copy()
    seen = np.zeros(len(x), bool)
    seen[prompt + out] = True
    counts = np.bincount(out, minlength=len(x)).astype(np.float64)
    r = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    for t, b in sp.logit_bias:
        x[t] += b
    if len(out) < sp.min_tokens:
        x[list(stop_ids)] = -np.inf
    return x


def reference_greedy(model, prompt: list[int], n: int, sp: SamplingParams, stop_ids=()) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        x = reference_shape(reference_logits(model, prompt + out)[-1].numpy(), prompt, out, sp, stop_ids)
        out.append(int(np.argmax(x)))
        if out[-1] in stop_ids:
            break
    return out


RULES = hst.builds(
    SamplingParams,
    repetition_penalty=hst.sampled_from([1.0, 1.2, 1.8, 0.7]),
    frequency_penalty=hst.sampled_from([0.0, 0.3, 1.5, -0.5]),
    presence_penalty=hst.sampled_from([0.0, 0.5, 2.0]),
    logit_bias=hst.lists(hst.tuples(hst.integers(0, 511), hst.sampled_from([-100.0, -2.0, 3.0, 100.0])),
                         max_size=3, unique_by=lambda tb: tb[0]).map(tuple),
    min_tokens=hst.integers(0, 8),
)


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama", vocab_size=512, num_layers=2, seed=0)


@pytest.fixture(scope="module")
def gen(pair):
    g = pair.generator(capacity=256, stop_ids={0, 1})
    yield g
    g.close()


@given(sp=RULES, prompt=hst.sampled_from(PROMPTS))
@SETTINGS
def test_rules_greedy_every_strategy_equals_ar(pair, gen, sp, prompt):
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=24, sampling=sp).token_ids
    assert ref == reference_greedy(pair.target, prompt, 24, sp, stop_ids=(0, 1))
    for name in STRATEGIES:
        got = gen.generate(prompt, strategy=name, max_new_tokens=24, sampling=sp).token_ids
        assert got == ref, (name, sp)


def test_rules_change_the_output(gen):
    """Each rule alone changes ar's greedy output on a repetitive prompt (the equality above is not vacuous)."""
    prompt = PROMPTS[0]
    plain = gen.generate(prompt, strategy="ar", max_new_tokens=24).token_ids
    for sp in (SamplingParams(repetition_penalty=1.8), SamplingParams(frequency_penalty=1.5),
               SamplingParams(presence_penalty=2.0), SamplingParams(logit_bias=((7, 100.0),))):
        assert gen.generate(prompt, strategy="ar", max_new_tokens=24, sampling=sp).token_ids != plain, sp


def test_min_tokens_and_stop_token_ids(gen):
    prompt = PROMPTS[1]
    plain = gen.generate(prompt, strategy="ar", max_new_tokens=12).token_ids
    stop = plain[3]
    cut = gen.generate(prompt, strategy="staged", max_new_tokens=12, stop_token_ids=[stop])
    assert cut.token_ids == plain[:plain.index(stop) + 1] and cut.finish_reason == "stop"
    # a stop token forced by logit_bias is suppressed until min_tokens tokens were emitted
    sp = SamplingParams(logit_bias=((1, 100.0),), min_tokens=5)
    for name in ("ar", "chain", "staged"):
        out = gen.generate(prompt, strategy=name, max_new_tokens=12, sampling=sp)
        assert out.token_ids[-1] == 1 and len(out.token_ids) == 6 and out.finish_reason == "stop", name


def test_logprobs_every_strategy_equal_ar_and_reference(pair, gen):
    prompt = PROMPTS[0]
    sp = SamplingParams(logprobs=3, frequency_penalty=0.5)
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=20, sampling=sp)
    assert len(ref.logprobs) == len(ref.token_ids)
    for i, lp in enumerate(ref.logprobs):
        want = torch.log_softmax(reference_logits(pair.target, prompt + ref.token_ids[:i])[-1].double(), -1)
        assert lp.token == ref.token_ids[i]
        assert abs(lp.logprob - float(want[lp.token])) < 1e-4
        assert [t for t, _ in lp.top] == want.topk(3).indices.tolist()
    for name in STRATEGIES:
        got = gen.generate(prompt, strategy=name, max_new_tokens=20, sampling=sp)
        assert got.token_ids == ref.token_ids
        assert [a.token for a in got.logprobs] == ref.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, ref.logprobs)) < 1e-4, name
        assert all([t for t, _ in a.top] == [t for t, _ in b.top] for a, b in zip(got.logprobs, ref.logprobs)), name
    streamed = [lp for step in gen.submit(prompt, strategy="staged", max_new_tokens=20, sampling=sp)
                for lp in step.logprobs]
    assert [lp.token for lp in streamed] == ref.token_ids


def test_bad_rules_are_refused(gen):
    for kwargs in ({"repetition_penalty": 0.0}, {"frequency_penalty": float("inf")}, {"min_tokens": -1},
                   {"logprobs": 21}, {"logit_bias": ((3, float("nan")),)}):
        with pytest.raises(RequestError):
            SamplingParams(**kwargs)
    with pytest.raises(RequestError, match="logit_bias token id 512"):
        gen.submit([1, 2], sampling=SamplingParams(logit_bias=((512, 1.0),)))
    with pytest.raises(RequestError, match="stop token id -1"):
        gen.submit([1, 2], stop_token_ids=[-1])


def test_batch_invariance_with_other_rules(gen):
    """Requests with different rules (and none) running together each get their solo output."""
    jobs = [(PROMPTS[0], "staged", SamplingParams(frequency_penalty=1.0, logprobs=2)),
            (PROMPTS[1], "chain", SamplingParams(repetition_penalty=1.5)),
            (PROMPTS[2], "dyspec", SamplingParams()),
            (PROMPTS[0], "gsd", SamplingParams(logit_bias=((99, 5.0),), min_tokens=3))]
    solo = [gen.generate(p, strategy=s, max_new_tokens=20, sampling=sp).token_ids for p, s, sp in jobs]
    handles = [gen.submit(p, strategy=s, max_new_tokens=20, sampling=sp) for p, s, sp in jobs]
    assert [h.result().token_ids for h in handles] == solo


# ---------------------------------------------------------------------------------------------
# Sampled: chi-square of the first two tokens (16-token pair: every outcome is counted)
# ---------------------------------------------------------------------------------------------

PEN = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5,
                     logit_bias=((3, 2.0), (5, -1.0)))


def exact_first_two_under_rules(model, prompt: list[int], sp: SamplingParams, mask=None) -> np.ndarray:
    """test_sampling_exact.exact_first_two under the request's rules: [V, V] joint of the first two
    tokens; `mask(out) -> bool [V]` for a grammar."""
    def probs(out):
        x = reference_shape(reference_logits(model, prompt + out)[-1].numpy(), prompt, out, sp)
        if mask is not None:
            x = np.where(mask(out), x, -np.inf)
        return reference_probs(torch.from_numpy(x), sp)
    p1 = probs([])
    joint = np.zeros((len(p1), len(p1)))
    for t in np.flatnonzero(p1):
        joint[t] = p1[t] * probs([int(t)])
    return joint


@pytest.mark.parametrize("strategy", [ChainSpeculative(2), Staged(budget=6)], ids=["chain", "staged"])
def test_penalties_sampled_exact(small_pair, small_gen, strategy):
    prompt = [1, 2, 3, 1, 2, 3, 1]
    joint = exact_first_two_under_rules(small_pair.target, prompt, PEN)
    counts = sample_first(small_gen, prompt, strategy, PEN, 1200, 30_000)
    p = chisquare_p(counts, joint)
    print(f"[pvalue] penalties {strategy.name}: {p:.3g}")
    assert p > PASS_P


# ---------------------------------------------------------------------------------------------
# Grammars (the tiny tokenizer: 512 byte-level BPE tokens, <|endoftext|> = 0)
# ---------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}
REGEX = "(yes|no|maybe)( indeed)*"
GRAMMARS = [Grammar("regex", REGEX), Grammar("json_schema", json.dumps(SCHEMA)), Grammar("json_object", ""),
            Grammar("lark", 'start: "x" ("=" NUM)+\nNUM: /[0-9]{1,3}/')]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ROOT / "trtspec" / "assets" / "tiny-tokenizer")


@pytest.fixture(scope="module")
def ggen(pair, tok):
    g = pair.generator(capacity=256, tokenizer=tok, stop_ids={0})
    yield g
    g.close()


def finished_text_ok(grammar: Grammar, text: str) -> bool:
    if grammar.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if grammar.kind == "lark":
        return re.fullmatch(r"x(=[0-9]{1,3})+", text) is not None
    value = json.loads(text)
    if grammar.kind == "json_object":
        return isinstance(value, dict)
    import jsonschema
    jsonschema.validate(value, SCHEMA)
    return True


@pytest.mark.parametrize("grammar", GRAMMARS, ids=[g.kind for g in GRAMMARS])
def test_grammar_greedy_every_strategy_equals_ar(ggen, tok, grammar):
    prompt = tok.encode("hello world, the answer is")
    sp = SamplingParams(grammar=grammar)
    ref = ggen.generate(prompt, strategy="ar", max_new_tokens=48, sampling=sp)
    if ref.finish_reason == "stop":
        assert finished_text_ok(grammar, tok.decode(ref.token_ids[:-1]))
    pruned = 0
    for name in STRATEGIES:
        got = ggen.generate(prompt, strategy=name, max_new_tokens=48, sampling=sp)
        assert got.token_ids == ref.token_ids, name
        pruned += sum(s.extra.get("pruned", 0) for s in got.steps)
    assert pruned > 0                      # drafts the grammar forbids were proposed, and pruned


@pytest.mark.parametrize("strategy", ["chain", "staged", "dyspec", "gsd", "cascade"])
def test_drafts_follow_the_grammar(ggen, tok, strategy, monkeypatch):
    """The draft's distributions are masked by the grammar after each node's path: it proposes what
    the grammar allows (fewer pruned nodes, more accepted per step) and the output is unchanged."""
    prompt = tok.encode("hello world, the answer is")
    sp = SamplingParams(grammar=GRAMMARS[1])
    masked = ggen.generate(prompt, strategy=strategy, max_new_tokens=48, sampling=sp)
    monkeypatch.setattr(DecodeState, "constrain", lambda self, logits, paths: logits)
    unmasked = ggen.generate(prompt, strategy=strategy, max_new_tokens=48, sampling=sp)
    assert masked.token_ids == unmasked.token_ids
    pruned = [sum(s.extra.get("pruned", 0) for s in r.steps) for r in (masked, unmasked)]
    assert pruned[0] < pruned[1], pruned
    assert masked.stats["mean_accepted"] > unmasked.stats["mean_accepted"]


@pytest.mark.parametrize("grammar", GRAMMARS[:2], ids=["regex", "json_schema"])
def test_grammar_sampled_outputs_match(ggen, tok, grammar):
    prompt = tok.encode("the answer:")
    sp = SamplingParams(temperature=1.0, grammar=grammar)
    done = 0
    for seed in range(12):
        out = ggen.generate(prompt, strategy="staged", max_new_tokens=40, sampling=sp, seed=seed)
        if out.finish_reason == "stop":
            done += 1
            assert finished_text_ok(grammar, tok.decode(out.token_ids[:-1]))
    assert done >= 3


def grammar_mask(ggen, grammar):
    """mask(out) -> bool [V]: what the grammar allows after `out` (from a fresh matcher)."""
    from trtspec.runtime.grammar import unpack
    memo = {}

    def mask(out):
        key = tuple(out)
        if key not in memo:
            state = ggen.grammars.start(grammar)
            state.consume(out)
            bits = np.zeros((1, state.words), dtype=np.int32)
            state._fill(bits, 0)
            memo[key] = unpack(bits, 512)[0]
        return memo[key]
    return mask


def test_grammar_sampled_exact(pair, ggen, tok):
    """First two tokens under a regex, sampled: chain (sampled drafts, many pruned) and staged."""
    grammar = Grammar("regex", "(ab|a|b|c)(d|e|f)(g)*")
    prompt = tok.encode("x")
    mask = grammar_mask(ggen, grammar)
    sp = SamplingParams(temperature=1.0, grammar=grammar)
    joint = exact_first_two_under_rules(pair.target, prompt, sp, mask)
    assert (joint > 0).sum() >= 6
    for strategy, seed0 in ((ChainSpeculative(2), 40_000), (Staged(budget=6), 50_000)):
        p = chisquare_p(sample_first(ggen, prompt, strategy, sp, 800, seed0), joint)
        print(f"[pvalue] grammar {strategy.name}: {p:.3g}")
        assert p > PASS_P


def test_batch_invariance_with_grammars_and_choices(ggen, tok):
    """Requests with a grammar, penalties, logprobs and n = 3 choices, sharing batches with plain
    ones, each get their solo output (choices: each equal to a lone request with its seed)."""
    p = tok.encode("hello world, the answer is")
    jobs = [(p, "staged", SamplingParams(grammar=GRAMMARS[1])),
            (p, "chain", SamplingParams(grammar=GRAMMARS[0], logprobs=1)),
            (p, "dyspec", SamplingParams(presence_penalty=1.0)),
            (p[:3], "gsd", SamplingParams())]
    solo = [ggen.generate(q, strategy=s, max_new_tokens=24, sampling=sp).token_ids for q, s, sp in jobs]
    t1 = SamplingParams(temperature=1.0, grammar=GRAMMARS[3])
    fixed = Staged(budget=6)              # sampled: a fixed tree (budget: auto sizes trees by the batch)
    from trtspec.runtime.generator import choice_seed
    solo_choices = [ggen.generate(p, strategy=fixed, max_new_tokens=16, sampling=t1, seed=s).token_ids
                    for s in (9, choice_seed(9, 1), choice_seed(9, 2))]
    handles = [ggen.submit(q, strategy=s, max_new_tokens=24, sampling=sp) for q, s, sp in jobs]
    choices = ggen.submit_choices(p, 3, seed=9, strategy=fixed, max_new_tokens=16, sampling=t1)
    assert [h.result(timeout=120).token_ids for h in handles] == solo
    assert [h.result(timeout=120).token_ids for h in choices] == solo_choices


LARK_NUM = Grammar("lark", 'start: "x=" NUM\nNUM: /[0-9]{1,2}/')


def test_jump_forward_emits_forced_tokens_without_their_own_step(ggen, tok, monkeypatch):
    """Tokens the grammar forces (one legal token) ride on the step that reaches them: `ar` under a
    JSON schema takes fewer target steps than it emits tokens, with the same output as without
    jump-forward; every strategy equals it. The forced tokens are a drafter (`grammar`) that a
    strategy may also list: with the step's jump-forward off, `ngram:drafter=grammar` still skips
    steps on the forced chains it verifies, and `staged:drafter=grammar+ngram` equals `ar`."""
    from trtspec.runtime.drafters import Forced
    prompt = tok.encode("hello world, the answer is")
    sp = SamplingParams(grammar=GRAMMARS[1])
    fast = ggen.generate(prompt, strategy="ar", max_new_tokens=48, sampling=sp)
    forced = sum(s.extra.get("forced", 0) for s in fast.steps)
    assert forced > 0 and fast.stats["target_steps"] < len(fast.token_ids)
    with monkeypatch.context() as m:
        m.setattr(Forced, "grow", lambda self, st, proposal, masks, most=0: (proposal, masks))
        slow = ggen.generate(prompt, strategy="ar", max_new_tokens=48, sampling=sp)
        listed = ggen.generate(prompt, strategy="ngram:drafter=grammar", max_new_tokens=48, sampling=sp)
    assert slow.token_ids == fast.token_ids and slow.stats["target_steps"] == len(slow.token_ids)
    assert listed.token_ids == fast.token_ids and listed.stats["target_steps"] < len(listed.token_ids)
    assert all(set(s.extra.get("sources", {})) <= {"grammar"} for s in listed.steps)
    for name in [*STRATEGIES, "staged:drafter=grammar+ngram"]:
        assert ggen.generate(prompt, strategy=name, max_new_tokens=48, sampling=sp).token_ids == fast.token_ids, name


def test_jump_forward_sampled_exact(pair, ggen, tok):
    """Sampled under 'x=' NUM (x and = forced, then one or two digits, then the stop token forced):
    the output's distribution is the constrained target's, with forced tokens emitted by jump-forward
    (ar, chain, staged)."""
    mask = grammar_mask(ggen, LARK_NUM)
    prompt = tok.encode("value")
    sp = SamplingParams(temperature=1.0, grammar=LARK_NUM)
    head = [int(np.flatnonzero(mask([]))[0])]
    head.append(int(np.flatnonzero(mask(head))[0]))
    assert mask([]).sum() == 1 and mask(head[:1]).sum() == 1

    def probs(out):
        x = reference_shape(reference_logits(pair.target, prompt + out)[-1].numpy(), prompt, out, sp)
        return reference_probs(torch.from_numpy(np.where(mask(out), x, -np.inf)), sp)
    p1 = probs(head)
    joint = np.zeros((512, 512))
    for d in np.flatnonzero(p1):
        joint[d] = p1[d] * probs(head + [int(d)])
    for strategy, seed0 in (("ar", 60_000), (ChainSpeculative(2), 61_000), (Staged(budget=6), 62_000)):
        counts = np.zeros((512, 512), dtype=np.int64)
        steps = 0
        for i in range(600):
            out = ggen.generate(prompt, strategy=strategy, max_new_tokens=6, sampling=sp, seed=seed0 + i)
            assert out.token_ids[:2] == head and out.finish_reason == "stop"
            counts[out.token_ids[2], out.token_ids[3]] += 1
            steps += out.stats["target_steps"]
        p = chisquare_p(counts, joint)
        print(f"[pvalue] jump-forward {strategy if isinstance(strategy, str) else strategy.name}: {p:.3g}")
        assert p > PASS_P
        if strategy == "ar":
            assert steps < 600 * 3          # x and = (and a forced stop) never cost a step of their own


def test_bad_grammars_are_refused(ggen, gen):
    for grammar, why in ((Grammar("json_schema", "{not json"), "not valid JSON"),
                         (Grammar("regex", "(unclosed"), "cannot be compiled"),
                         (Grammar("lark", "start: undefined_rule"), "cannot be compiled")):
        with pytest.raises(RequestError, match=why):
            ggen.submit([5, 6], sampling=SamplingParams(grammar=grammar))
    with pytest.raises(RequestError, match="ignore_eos"):
        ggen.submit([5, 6], sampling=SamplingParams(grammar=GRAMMARS[0]), ignore_eos=True)
    with pytest.raises(RequestError, match="tokenizer"):
        gen.submit([5, 6], sampling=SamplingParams(grammar=GRAMMARS[0]))
    with pytest.raises(RequestError, match="unknown grammar kind"):
        Grammar("xml", "")
