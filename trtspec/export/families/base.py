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
    # what the transformers config needs beyond the common fields, or why a spec has none (a str)
    hf_extra: Callable[[object], dict | str] = field(default=lambda spec: {})
