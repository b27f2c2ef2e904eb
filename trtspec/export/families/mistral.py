"""Mistral: Llama's form (llama.cpp writes it as `llama`; the GGUF loader tells them apart by name)."""
from .base import Family, hf_window


def _extra(spec) -> dict | str:
    if spec.attention_bias:
        return "a mistral spec with attention bias has no transformers equivalent"
    return hf_window(spec, per_layer=False)


FAMILY = Family("mistral", ("mistral",), "MistralConfig", "MistralForCausalLM", hf_extra=_extra)
