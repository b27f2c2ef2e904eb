"""Qwen3 (dense): no q/k/v biases, an RMSNorm over each head of q and of k before rotary, head_dim
from the config (128 where hidden / heads is not)."""
from .base import Family, hf_window

FAMILY = Family("qwen3", ("qwen3",), "Qwen3Config", "Qwen3ForCausalLM", gguf="qwen3", qk_norm=True,
                hf_extra=lambda spec: {"attention_bias": spec.attention_bias, **hf_window(spec, per_layer=True)})
