"""Gemma 3's decoder (`gemma3_text`: Gemma 3 270M and 1B; `gemma3`: the language model of the 4B, 12B
and 27B multimodal checkpoints, read from `text_config` and `language_model.*`, the vision tower
left unread: text in, text out): RMSNorm
as (1 + w), embeddings times sqrt(hidden), GeGLU (tanh), q/k norms, four norms per layer, scores
scaled by query_pre_attn_scalar, and sliding-window layers beside global ones (every sixth), with
their own unscaled rotary base (spec.local_rope_theta). A windowed layer sees each row's last
`sliding_window` keys in logical order (model.py `window_mask`), so a tree node sees what the same
token does in sequential decoding. GGUF `gemma3`: llama.cpp's converter stores the norms as 1 + w
(read as they are: spec.norm_weights_shifted), and llama.cpp scales scores by head_dim (27B: by
hidden / heads) and takes windowed layers' pattern and local base from the file or its defaults."""
from .base import Family


def _extra(spec) -> dict:
    return {"hidden_activation": spec.hidden_act, "query_pre_attn_scalar": spec.query_pre_attn_scalar or spec.head_dim,
            "sliding_window": spec.sliding_window, "layer_types": spec.layer_types, "attention_bias": spec.attention_bias}


FAMILY = Family("gemma3", ("gemma3_text", "gemma3"), "Gemma3TextConfig", "Gemma3ForCausalLM", gguf="gemma3", qk_norm=True,
                rope_theta=1_000_000.0, tied=True, local_rope_theta=10_000.0, norm_offset=True, embed_scale=True,
                sandwich_norms=True, hf_extra=_extra,
                gguf_names=(("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                            ("post_ffw_norm", "post_feedforward_layernorm")),
                renamed=(("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")),
                foreign=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."))
