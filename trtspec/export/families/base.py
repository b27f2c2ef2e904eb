"""Family: the facts of one model family (export/families/__init__.py has the registry)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str                              # ModelSpec.arch
    hf_types: tuple[str, ...]              # config.json model_type values it reads
    hf_config: str                         # transformers' config class: the oracle and the HF peers
    hf_model: str                          # transformers' causal LM class
    gguf: str | None = None                # llama.cpp's general.architecture (None: no GGUF path yet)
    attention_bias: bool = False           # q/k/v biases when config.json does not say
    qk_norm: bool = False                  # an RMSNorm over each head of q and of k, before rotary
    gguf_rope_permuted: bool = False       # llama.cpp's converter permutes q/k rows (GPT-J rope)
    # checkpoint tensors that hold several Decoder weights, stacked by rows (Phi-3's qkv_proj and
    # gate_up_proj): (the joined module's name, the Decoder modules it holds, in order)
    joined: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # what the transformers config needs beyond the common fields, or why a spec has none (a str)
    hf_extra: Callable[[object], dict | str] = field(default=lambda spec: {})


def unjoined(spec, key: str) -> list[tuple[str, int, int]] | None:
    """The Decoder weights that the checkpoint's joined tensor `key` holds, as (name, first row, end
    row); None where `key` is no joined tensor of the spec's family."""
    rows = {"self_attn.q_proj": spec.num_heads * spec.head_dim, "self_attn.k_proj": spec.num_kv_heads * spec.head_dim,
            "self_attn.v_proj": spec.num_kv_heads * spec.head_dim, "mlp.gate_proj": spec.intermediate_size,
            "mlp.up_proj": spec.intermediate_size}
    for joined, parts in spec.family.joined:
        if key.endswith(f".{joined}.weight"):
            prefix, start, out = key[:-len(f"{joined}.weight")], 0, []
            for part in parts:
                out.append((f"{prefix}{part}.weight", start, start + rows[part]))
                start += rows[part]
            return out
    return None
