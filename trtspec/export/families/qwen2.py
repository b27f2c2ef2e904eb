"""Qwen2 / Qwen2.5: q/k/v biases."""
from .base import Family


def _extra(spec) -> dict | str:
    if not spec.attention_bias:
        return "a qwen2 spec without attention bias has no transformers equivalent (Qwen2 always has q/k/v biases)"
    return {"use_sliding_window": False, "sliding_window": None}


FAMILY = Family("qwen2", ("qwen2",), "Qwen2Config", "Qwen2ForCausalLM", gguf="qwen2", attention_bias=True,
                hf_extra=_extra)
