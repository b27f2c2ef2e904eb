"""The step contract's graph I/O, as data: written into manifest.json and used to check engines.

Symbolic dims: B = batch, T = new_tokens, C = past_len, S = total_len (= C + T), R = logit_rows.
Version 2 added the batch axis (version 1 had none).

GRAPH_REVISION numbers changes inside the graph that keep its I/O (engine folders of an older
revision still run, more slowly): 2 = attention reads each layer's past where it lies (revision 1
concatenated the past with the new rows, a copy of the whole past per layer per step).
"""
from __future__ import annotations

from .spec import ModelSpec

CONTRACT_VERSION = 2
GRAPH_REVISION = 2


def io_spec(spec: ModelSpec, dtype: str) -> dict[str, list[dict]]:
    kv = [spec.num_kv_heads, spec.head_dim]
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "new_tokens"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "new_tokens"]},
        {"name": "attn_mask", "dtype": "bool", "shape": ["batch", "new_tokens", "total_len"]},
        {"name": "logit_rows", "dtype": "int64", "shape": ["batch", "logit_rows"]},
    ]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["batch", "logit_rows", spec.vocab_size]}]
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append({"name": f"past_{kind}.{i}", "dtype": dtype, "shape": ["batch", "past_len", *kv]})
            outputs.append({"name": f"new_{kind}.{i}", "dtype": dtype, "shape": ["batch", "new_tokens", *kv]})
    return {"inputs": inputs, "outputs": outputs}
