"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's form with q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` in the checkpoint (split by rows as they load), rotary over part of each head where
`partial_rotary_factor` says (Phi-4-mini: 3/4), and `longrope` scaling (spec.py, model.py). GGUF
`phi3`: joined tensors split as they load, longrope's factors from its tensors; no sliding window
(llama.cpp reads none from these files)."""
from .base import Family, hf_window


def _extra(spec) -> dict | str:
    rs, window = spec.rope_scaling or {}, hf_window(spec, per_layer=False)
    if isinstance(window, str):
        return window
    return {"partial_rotary_factor": spec.rope_dim / spec.head_dim, **window,
            **({"original_max_position_embeddings": rs["original_max_position_embeddings"]}
               if "original_max_position_embeddings" in rs else {})}


FAMILY = Family("phi3", ("phi3",), "Phi3Config", "Phi3ForCausalLM", gguf="phi3", hf_extra=_extra,
                # llama.cpp's converter keeps q/k/v and gate/up joined, as the checkpoint does
                gguf_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
                joined=(("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))))
