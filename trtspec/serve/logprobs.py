"""OpenAI's logprobs objects from the runtime's TokenLogprob records.

The values are the target's own log-probabilities (log-softmax of its raw logits, before penalties,
logit_bias, a grammar and temperature: vLLM's default), read at the node each token was drawn at, so
every strategy reports what `ar` reports for the same tokens. A token's text is its own decoding
(a token holding part of a multi-byte character decodes to U+FFFD, as in vLLM); `bytes` are that
text's UTF-8 bytes.
"""
from __future__ import annotations


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat(tokenizer, logprobs: list) -> dict:
    """The chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def entry(token: int, value: float) -> dict:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}
    return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion(tokenizer, logprobs: list, offset: int = 0) -> dict:
    """The completion choice's `logprobs`: tokens, token_logprobs, top_logprobs, text_offset (from `offset`)."""
    tokens = [_text(tokenizer, lp.token) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [_top(tokenizer, lp.top) for lp in logprobs], "text_offset": offsets}


def _top(tokenizer, top) -> dict[str, float]:
    """{text: logprob}, best first; tokens whose texts collide (partial characters all decode to
    U+FFFD) keep the best value."""
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(_text(tokenizer, t), v)
    return out
