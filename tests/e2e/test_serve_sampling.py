"""Issue 28 through `trtspec serve` and the official `openai` client: structured outputs, logprobs,
penalties and biases, exact under every strategy, streamed or not.

Each is also a regression test for a failure reported in other servers' speculative decoding:
grammars ignored or crashing under speculation (vLLM #9423, #11484, #15554; SGLang #9187, #13019):
every strategy's greedy output under a schema equals `ar`'s and every finished output validates;
logprobs wrong or disabled under speculation (vLLM #34497, llama.cpp #27196): every strategy reports
`ar`'s logprobs; greedy output differing from non-speculative output (vLLM #7627): equality with
`ar` under every feature.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_serve import MODEL, Server, folder, run_json, server_tokenizer, spec  # noqa: F401 - `folder`: fixture

from trtspec.runtime.strategies import STRATEGIES

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Is 7 prime? Answer in JSON."}]


@pytest.fixture(scope="module")
def server(folder):  # noqa: F811
    s = Server(folder)
    yield s
    s.stop()


def chat(c, strategy: str, **kw):
    kw = {"max_tokens": 48, "temperature": 0} | kw
    return c.chat.completions.create(model=MODEL, messages=MSGS, extra_body=spec(strategy) | kw.pop("extra_body", {}),
                                     **kw)


def test_json_schema_every_strategy_equals_ar_and_validates(server):
    c = server.client()
    ref = chat(c, "ar", response_format=FORMAT).choices[0]
    assert ref.finish_reason == "stop"
    jsonschema.validate(json.loads(ref.message.content), SCHEMA)
    for name in STRATEGIES:
        got = chat(c, name, response_format=FORMAT).choices[0]
        assert got.message.content == ref.message.content and got.finish_reason == "stop", name
        streamed = chat(c, name, response_format=FORMAT, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == ref.message.content


def test_json_object_regex_and_lark(server):
    c = server.client()
    out = chat(c, "staged", response_format={"type": "json_object"}, max_tokens=200).choices[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    else:
        assert out.message.content.startswith("{")
    via_json = chat(c, "chain", extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0]
    assert via_json.message.content == chat(c, "ar", response_format=FORMAT).choices[0].message.content
    for so, pattern in (({"regex": "(yes|no)( indeed)*"}, r"(yes|no)( indeed)*"),
                        ({"grammar": 'start: "x" ("=" NUM)+\nNUM: /[0-9]{1,3}/'}, r"x(=[0-9]{1,3})+")):
        texts = {name: chat(c, name, extra_body={"structured_outputs": so}).choices[0] for name in ("ar", "chain", "dyspec")}
        assert len({t.message.content for t in texts.values()}) == 1, texts
        if texts["ar"].finish_reason == "stop":
            assert re.fullmatch(pattern, texts["ar"].message.content)
        else:
            assert re.match(pattern, texts["ar"].message.content)


def test_logprobs_every_strategy_equal_ar(server):
    c = server.client()
    kw = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0, "logprobs": 3}
    ref = c.completions.create(**kw, extra_body=spec("ar")).choices[0].logprobs
    assert len(ref.tokens) == len(ref.token_logprobs) == len(ref.top_logprobs) == 16
    assert all(len(top) <= 3 and max(top.values()) >= lp - 1e-6 for top, lp in zip(ref.top_logprobs, ref.token_logprobs))
    for name in STRATEGIES:
        got = c.completions.create(**kw, extra_body=spec(name)).choices[0].logprobs
        assert got.tokens == ref.tokens, name
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref.token_logprobs)) < 1e-4, name
        chunks = list(c.completions.create(**kw, stream=True, extra_body=spec(name)))
        streamed = [lp for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for lp in ch.choices[0].logprobs.token_logprobs]
        assert max(abs(a - b) for a, b in zip(streamed, ref.token_logprobs)) < 1e-4 and len(streamed) == 16, name
    # chat: logprobs + top_logprobs, with a grammar and penalties in force (the values stay the target's own)
    r = chat(c, "staged", logprobs=True, top_logprobs=2, response_format=FORMAT, frequency_penalty=0.5).choices[0]
    a = chat(c, "ar", logprobs=True, top_logprobs=2, response_format=FORMAT, frequency_penalty=0.5).choices[0]
    assert [x.token for x in r.logprobs.content] == [x.token for x in a.logprobs.content]
    assert all(len(x.top_logprobs) == 2 for x in r.logprobs.content)
    assert max(abs(x.logprob - y.logprob) for x, y in zip(r.logprobs.content, a.logprobs.content)) < 1e-4
    assert chat(c, "staged").choices[0].logprobs is None


def test_penalties_and_biases_every_strategy_equal_ar(server):
    c = server.client()
    kw = {"model": MODEL, "prompt": "x = 1\ny = 2\n", "max_tokens": 24, "temperature": 0, "presence_penalty": 0.8,
          "frequency_penalty": 0.6, "logit_bias": {"5": 4.0, "17": -100}}
    extra = {"repetition_penalty": 1.3, "min_tokens": 4}
    plain = c.completions.create(model=MODEL, prompt=kw["prompt"], max_tokens=24, temperature=0).choices[0].text
    ref = c.completions.create(**kw, extra_body=spec("ar") | extra).choices[0].text
    assert ref != plain
    for name in STRATEGIES:
        assert c.completions.create(**kw, extra_body=spec(name) | extra).choices[0].text == ref, name


def test_stop_token_ids(server, folder):  # noqa: F811
    want = run_json(folder, "import numpy as np\n", "ar", 12)["token_ids"]
    stop = want[4]
    tok = server_tokenizer(folder)
    c = server.client()
    for name in ("ar", "staged"):
        cut = c.completions.create(model=MODEL, prompt="import numpy as np\n", max_tokens=12, temperature=0,
                                   extra_body=spec(name) | {"stop_token_ids": [stop]}).choices[0]
        kept = want[:want.index(stop) + 1]
        assert cut.text == tok.decode(kept, skip_special_tokens=True) and cut.finish_reason == "stop", name


def test_n_choices(server):
    c = server.client()
    kw = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3, "logprobs": 1}
    fixed = spec("staged", budget=6)        # sampled: a fixed tree (budget: auto sizes trees by the batch)
    got = c.completions.create(**kw, extra_body=fixed)
    assert [ch.index for ch in got.choices] == [0, 1, 2]
    assert len({ch.text for ch in got.choices}) == 3
    assert got.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in got.choices) == 36
    lone = c.completions.create(**dict(kw, n=1), extra_body=fixed)
    assert lone.choices[0].text == got.choices[0].text                   # choice 0 = a lone request, same seed
    again = c.completions.create(**kw, extra_body=fixed)
    assert [ch.text for ch in again.choices] == [ch.text for ch in got.choices]    # the seed fixes the set
    stream = list(c.completions.create(**kw, stream=True, extra_body=fixed))
    texts = ["", "", ""]
    finished = set()
    for ch in stream:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [ch.text for ch in got.choices] and finished == {0, 1, 2}
    chat_out = chat(c, "dyspec", n=2, temperature=0)
    assert chat_out.choices[0].message.content == chat_out.choices[1].message.content   # greedy: equal choices


def test_prefix_cache_hits_in_usage_and_metrics(server):
    from test_serve import metric_values
    c = server.client()
    system = "You are a careful assistant. " * 30
    before = metric_values(server)
    outs = [c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                             {"role": "user", "content": q}],
                                      max_tokens=8, temperature=0) for q in ("first question", "second one")]
    after = metric_values(server)
    hits = after[("trtspec_prefix_cache_hits_total", (("model", "target"),))] - \
        before.get(("trtspec_prefix_cache_hits_total", (("model", "target"),)), 0)
    assert outs[1].usage.prompt_tokens_details.cached_tokens > 0
    assert hits >= outs[1].usage.prompt_tokens_details.cached_tokens
    assert after[("trtspec_prefix_cache_queries_total", (("model", "target"),))] >= outs[1].usage.prompt_tokens
