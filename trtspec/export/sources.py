"""Resolve a config's `model:` reference to a Decoder and a tokenizer.

    pack:NAME       demo model pack (pip data package), assembled and sha256-checked
    tiny:SEED       seeded random tiny model (target; as a draft: the matching noisy draft)
    PATH            Hugging Face folder (config.json + safetensors) or a .gguf file
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelEntry
from .model import Decoder
from .tiny import tiny_pair, tiny_spec

TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tiny-tokenizer"


def load_model(entry: ModelEntry, role: str) -> Decoder:
    if entry.model.startswith("tiny:"):
        seed = int(entry.model.split(":", 1)[1])
        target, draft = tiny_pair(tiny_spec(**entry.tiny), seed=seed, dtype=entry.torch_dtype)
        return target if role == "target" else draft
    from .checkpoint import load_checkpoint
    from .packs import resolve_model
    spec, state = load_checkpoint(resolve_model(entry.model), dtype=entry.torch_dtype)
    model = Decoder.from_state(spec, state, entry.torch_dtype)
    del state
    return model


def load_tokenizer_for(entry: ModelEntry):
    from .tokenizer import load_tokenizer
    if entry.model.startswith("tiny:"):
        return load_tokenizer(TINY_TOKENIZER)
    from .packs import resolve_model
    return load_tokenizer(resolve_model(entry.model))


def model_dtype(model: Decoder) -> torch.dtype:
    return model.model.embed_tokens.weight.dtype
