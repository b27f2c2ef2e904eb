"""Model families: what tells one decoder-only architecture from another, one file each, registered
by name here (`FAMILIES`). A family is the facts the loaders, the Decoder and the transformers oracle
read; the Decoder (export/model.py) is one class whose flags these are.

Adding one: a file with `FAMILY = Family(...)` and a line in `FAMILIES` (docs/ARCHITECTURE.md,
"Adding a model family"). Its tests: a tiny random model made from its transformers config class
gives transformers' logits (tests/unit/test_checkpoint.py takes every registered family).
"""
from __future__ import annotations

from .base import Family
from . import gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3_moe          # each defines FAMILY

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, mistral.FAMILY, qwen3.FAMILY,
                                                  phi3.FAMILY, gemma3.FAMILY, qwen3_moe.FAMILY)}


def by_hf_type(model_type: str) -> Family | None:
    return next((f for f in FAMILIES.values() if model_type in f.hf_types), None)


def by_gguf(arch: str) -> Family | None:
    return next((f for f in FAMILIES.values() if f.gguf == arch), None)
