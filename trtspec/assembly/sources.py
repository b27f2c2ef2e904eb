"""Resolve a config's `model:` reference to a Decoder and a tokenizer.

    pack:NAME       demo model pack (pip data package), assembled and sha256-checked
    tiny:SEED       seeded random tiny model (target; as a draft: the matching noisy draft)
    PATH            Hugging Face folder (config.json + safetensors) or a .gguf file

`layers: N` in the entry keeps the first N layers: a self-draft from the target's own weights.
"""
from __future__ import annotations

from pathlib import Path

from ..export.model import Decoder
from ..export.spec import ModelSpec
from ..export.tiny import tiny_pair, tiny_spec
from .config import ConfigError, ModelEntry

TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tiny-tokenizer"


def load_model(entry: ModelEntry, role: str) -> Decoder:
    if entry.model.startswith("tiny:"):
        seed = int(entry.model.split(":", 1)[1])
        target, draft = tiny_pair(tiny_spec(**entry.tiny.model_dump()), seed=seed, dtype=entry.torch_dtype)
        return target if role == "target" else draft
    from ..export.checkpoint import load_checkpoint
    from ..export.packs import resolve_model
    spec, state = load_checkpoint(resolve_model(entry.model), dtype=entry.torch_dtype)
    if entry.layers:
        spec, state = truncate_layers(spec, state, entry.layers)
    model = Decoder.from_state(spec, state, entry.torch_dtype)
    del state
    return model


def open_source(entry: ModelEntry, role: str):
    """The entry's weights, read one tensor at a time (engines/weights.py): what a streaming build
    needs instead of `load_model`'s Decoder. Tiny models are made in memory."""
    from ..engines.weights import StateWeights, open_weights
    if entry.model.startswith("tiny:"):
        model = load_model(entry, role)
        return StateWeights(model.spec, model.state_dict())
    from ..export.packs import resolve_model
    weights = open_weights(resolve_model(entry.model))
    return weights.layers(entry.layers) if entry.layers else weights


def truncate_layers(spec: ModelSpec, state: dict, n: int) -> tuple[ModelSpec, dict]:
    """The first n layers with the model's own final norm and head: an early-exit self-draft that
    shares the target's tokenizer by construction (LayerSkip-style drafting, without training)."""
    if n >= spec.num_layers:
        raise ConfigError(f"layers: {n} must be below the model's {spec.num_layers} layers")
    from ..engines.weights import in_first_layers
    keep = {k: v for k, v in state.items() if in_first_layers(k, n)}
    return spec.first_layers(n), keep


def load_tokenizer_for(entry: ModelEntry):
    from ..export.tokenizer import load_tokenizer
    if entry.model.startswith("tiny:"):
        return load_tokenizer(TINY_TOKENIZER)
    from ..export.packs import resolve_model
    return load_tokenizer(resolve_model(entry.model))

