"""Llama (1, 2, 3.x): the base form every other family here varies."""
from .base import Family

FAMILY = Family("llama", ("llama",), "LlamaConfig", "LlamaForCausalLM", gguf="llama", gguf_rope_permuted=True,
                hf_extra=lambda spec: {"attention_bias": spec.attention_bias, "mlp_bias": False})
