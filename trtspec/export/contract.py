"""The step contract's graph I/O, as data: written into manifest.json and used to check engines.

Symbolic dims: B = batch, T = new_tokens, C = past_len, S = total_len (= C + T), R = logit_rows.
Version 2 added the batch axis (version 1 had none). Version 3 is head-major: one past/new tensor per
layer *and KV head*, `[B, C, D]`, so a slot's rows of one head are one contiguous block of a
`[.., Hkv, S, D]` pool and attention reads them without transposing the past (version 2 took one
`[B, C, Hkv, D]` tensor per layer, which the graph transposed every step).

Version 4 adds the hidden rows (`hidden`, [B, R, hidden_size] float32, after every KV output): the
last layer's rows that the LM head reads (after the final norm), for the same `logit_rows`: what a
drafting head (EAGLE, Medusa, MTP) reads from the target. They are optional: a build asks for them
with `target.hidden_rows: true` (`Decoder.hidden_rows`), and a graph without them is a version 3
graph, so `verify` runs v3 folders as they are (READS). The ONNX Runtime engine and the torch
engines (the CUDA-graph one in its buckets' own buffers) bind them (`Engine.hidden`); ONNX
Runtime's CUDA-graph engine and TensorRT plans do not yet, and the config refuses them there.

GRAPH_REVISION numbers changes inside the graph that keep its I/O (engine folders of an older
revision still run, more slowly): 2 = attention reads each layer's past where it lies (revision 1
concatenated the past with the new rows, a copy of the whole past per layer per step).
"""
from __future__ import annotations

from .spec import ModelSpec

CONTRACT_VERSION = 4
READS = (3, 4)          # the contract versions this trtspec runs (v3 = v4 without hidden rows)
GRAPH_REVISION = 2


def io_names(num_layers: int, num_kv_heads: int, hidden: bool = False) -> tuple[list[str], list[str]]:
    """(input names, output names) in graph order; KV ordered (layer, key/value, head) like
    `Decoder`'s lists and a slot's `[L, 2, Hkv]` blocks; `hidden`: the hidden rows last."""
    kv = [f"{kind}.{i}.{h}" for i in range(num_layers) for kind in ("key", "value") for h in range(num_kv_heads)]
    past, new = [f"past_{n}" for n in kv], [f"new_{n}" for n in kv]
    return ["input_ids", "position_ids", "attn_mask", "logit_rows", *past], ["logits", *new, *(["hidden"] * hidden)]


def io_spec(spec: ModelSpec, dtype: str, hidden: bool = False) -> dict[str, list[dict]]:
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "new_tokens"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "new_tokens"]},
        {"name": "attn_mask", "dtype": "bool", "shape": ["batch", "new_tokens", "total_len"]},
        {"name": "logit_rows", "dtype": "int64", "shape": ["batch", "logit_rows"]},
    ]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["batch", "logit_rows", spec.vocab_size]}]
    past, new = io_names(spec.num_layers, spec.num_kv_heads)
    inputs += [{"name": n, "dtype": dtype, "shape": ["batch", "past_len", spec.head_dim]} for n in past[4:]]
    outputs += [{"name": n, "dtype": dtype, "shape": ["batch", "new_tokens", spec.head_dim]} for n in new[1:]]
    if hidden:
        outputs.append({"name": "hidden", "dtype": "float32", "shape": ["batch", "logit_rows", spec.hidden_size]})
    return {"inputs": inputs, "outputs": outputs}
