"""Qwen2 / Qwen2.5: q/k/v biases."""
from .base import Family, hf_window


def _extra(spec) -> dict | str:
    if not spec.attention_bias:
        return "a qwen2 spec without attention bias has no transformers equivalent (Qwen2 always has q/k/v biases)"
    return hf_window(spec, per_layer=True)


FAMILY = Family("qwen2", ("qwen2",), "Qwen2Config", "Qwen2ForCausalLM", gguf="qwen2", attention_bias=True,
                hf_extra=_extra)
