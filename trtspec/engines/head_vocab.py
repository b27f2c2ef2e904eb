"""A draft's LM head over the tokens text actually uses (`draft: {head: N}`; FR-Spec, arXiv 2502.14856).

A 0.5B draft's head over Qwen's 151,936 tokens is a quarter of its forward, though code and chat use
a few tens of thousands of them. With `head: N` the draft's graph computes logits for N tokens only,
and gives every other token a logit of LOW (probability exactly 0 after softmax, yet finite, so a
grammar or penalty applied to a draft row never meets NaN). The draft then never proposes a token
outside its head; the target verifies every token as before, so outputs are unchanged (lossless:
greedy is the target's own, and sampled rejection sampling takes q(x) = 0 as it takes any q).

Which N tokens: measured at build time on a corpus every Python install has, its standard library
(code, docstrings and comments, and `pydoc_data/topics.py`, the language reference in English prose),
tokenized by the model's own tokenizer and ranked by count; tokens the corpus never produces follow
in token-id order (a BPE vocabulary's ids follow its merge order, which roughly follows the
frequency in the tokenizer's own training text), and every added/special token (chat markers, EOS)
is always in. Deterministic for a given Python version and tokenizer.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

LOW = -1e30                 # a token outside the head: exp(LOW - max) is 0, LOW / temperature finite
CORPUS_BYTES = 16 << 20     # at most this much of the standard library (12.6 MB in Python 3.11)


def corpus() -> list[Path]:
    """The standard library's own .py files (its tests excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(p.relative_to(root).parts))
    out, size = [], 0
    for p in files:
        size += p.stat().st_size
        if size > CORPUS_BYTES:
            break
        out.append(p)
    return out


def token_counts(tokenizer, vocab_size: int, files: list[Path] | None = None) -> np.ndarray:
    """How often each token id occurs in the corpus, tokenized by `tokenizer`."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    files = corpus() if files is None else files
    for i in range(0, len(files), 64):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i:i + 64]]
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]])
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def head_tokens(tokenizer, n: int, vocab_size: int, counts: np.ndarray | None = None) -> np.ndarray:
    """The sorted ids of the draft head's `n` tokens (all of them when n >= vocab_size)."""
    if n >= vocab_size:
        return np.arange(vocab_size, dtype=np.int64)
    counts = token_counts(tokenizer, vocab_size) if counts is None else counts
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size]
    special += [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= i < vocab_size]
    keep = np.zeros(vocab_size, dtype=bool)
    keep[special] = True
    order = np.lexsort((np.arange(vocab_size), -counts))   # by count, then by id
    keep[order[~keep[order]][:max(0, n - int(keep.sum()))]] = True
    return np.flatnonzero(keep)


def head_nodes(logits_head: str, logits: str, ids: np.ndarray, vocab_size: int):
    """Nodes and initializers that spread the head's [B, R, N] logits over the [B, R, V] vocabulary:
    a LOW column padded on, then one Gather by each token's column (N, the LOW one, for tokens
    outside the head)."""
    from onnx import helper, numpy_helper
    column = np.full(vocab_size, len(ids), dtype=np.int32)
    column[ids] = np.arange(len(ids), dtype=np.int32)
    inits = [numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 1], dtype=np.int64), "head/pads"),
             numpy_helper.from_array(np.array(LOW, dtype=np.float32), "head/low"),
             numpy_helper.from_array(column, "head/column")]
    nodes = [helper.make_node("Pad", [logits_head, "head/pads", "head/low"], ["head/padded"], name="head/pad"),
             helper.make_node("Gather", ["head/padded", "head/column"], [logits], axis=2, name="head/spread")]
    return nodes, inits
