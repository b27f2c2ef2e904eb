"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's form with q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` in the checkpoint (split by rows as they load), rotary over part of each head where
`partial_rotary_factor` says (Phi-4-mini: 3/4), and `longrope` scaling (spec.py, model.py)."""
from .base import Family


def _extra(spec) -> dict:
    rs = spec.rope_scaling or {}
    return {"partial_rotary_factor": spec.rope_dim / spec.head_dim, "sliding_window": None,
            **({"original_max_position_embeddings": rs["original_max_position_embeddings"]}
               if "original_max_position_embeddings" in rs else {})}


FAMILY = Family("phi3", ("phi3",), "Phi3Config", "Phi3ForCausalLM", hf_extra=_extra,
                joined=(("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))))
