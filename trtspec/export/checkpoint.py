"""Load a model checkpoint from disk: a Hugging Face folder or a llama.cpp GGUF file.

Both paths return the same thing, (ModelSpec, HF-named state dict), checked against the Decoder
layout here so a wrong file fails with one readable SpecError instead of a load_state_dict dump.
Tensors are converted to the target dtype one at a time, so a bf16 load never holds a float32 copy
of the whole model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .families.base import decoder_names
from .gguf_loader import load_gguf
from .model import Decoder
from .spec import ModelSpec, SpecError

_FOLDER_HINT = "a Hugging Face model folder (config.json + *.safetensors) or a .gguf file"


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise SpecError(f"{index} lists shards that are missing: {', '.join(missing[:3])}; "
                            "download the complete checkpoint (all shards)")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = "pytorch_model.bin" if any(folder.glob("pytorch_model*.bin")) else "no weight files"
        raise SpecError(f"{folder} has no *.safetensors weights (found {found}); re-save the model with "
                        "model.save_pretrained(folder, safe_serialization=True) or download its safetensors")
    return files


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config = folder / "config.json"
    if not config.is_file():
        raise SpecError(f"{folder} has no config.json, so it is not a Hugging Face model folder; pass "
                        f"{_FOLDER_HINT}")
    cfg = json.loads(config.read_text())
    spec = ModelSpec.from_hf_config(cfg)
    spec.extra.update(source="hf", name=cfg.get("_name_or_path") or folder.name,
                      eos_token_ids=sorted(_hf_eos_ids(folder, cfg)))
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, set[int]] = {}                # stacked expert tensors: the indices filled
    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                parts = decoder_names(spec, key)     # renamed, split by rows (Phi-3's qkv_proj), an expert's, or none
                if not parts:
                    continue
                t = f.get_tensor(key)
                t = t.to(dtype) if t.is_floating_point() else t
                for part in parts:
                    if part.expert is not None:               # into its place of the stack
                        if part.name not in state:
                            state[part.name] = torch.empty((spec.num_experts, *t.shape), dtype=t.dtype)
                        if part.expert >= spec.num_experts:
                            raise SpecError(f"{folder}: {key} is expert {part.expert}, but the config says "
                                            f"{spec.num_experts}; use the config and weights of the same model")
                        state[part.name][part.expert] = t
                        experts.setdefault(part.name, set()).add(part.expert)
                    else:
                        state[part.name] = t if part.rows is None else t[part.rows].clone()
    for name, filled in experts.items():
        if len(filled) != spec.num_experts:
            raise SpecError(f"{folder}: {name} has {len(filled)} experts but the config says {spec.num_experts}; "
                            "use the config and weights of the same model")
    return spec, state


def _hf_eos_ids(folder: Path, cfg: dict) -> set[int]:
    """eos ids from config.json and generation_config.json (instruct models list their chat end there)."""
    ids: set[int] = set()
    sources = [cfg]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def check_layout(spec: ModelSpec, state: dict[str, torch.Tensor], source: str | os.PathLike) -> None:
    """SpecError unless `state` has exactly the Decoder's weights with the Decoder's shapes."""
    with torch.device("meta"):  # shapes only, no memory
        own = {k: tuple(v.shape) for k, v in Decoder(spec).state_dict().items()}
    ignored = {"lm_head.weight"} if spec.tie_word_embeddings else set()  # tied: a saved copy is fine
    own = {k: v for k, v in own.items() if k not in ignored}
    have = {k for k in state if not k.endswith("rotary_emb.inv_freq")} - ignored
    missing, unexpected = sorted(own.keys() - have), sorted(have - own.keys())
    if missing or unexpected:
        raise SpecError(f"{source}: the weights do not match a {spec.arch} model of this config (missing "
                        f"{missing[:3]}{' ...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
                        f"{' ...' if len(unexpected) > 3 else ''}); use the config and weights of the same model")
    for k, shape in own.items():
        if tuple(state[k].shape) != shape:
            raise SpecError(f"{source}: weight {k} has shape {tuple(state[k].shape)} but the config implies "
                            f"{shape}; the config does not describe these weights, use the config that came with them")


def load_checkpoint(path: str | os.PathLike,
                    dtype: torch.dtype = torch.float32) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(spec, HF-named state dict in `dtype`) from a Hugging Face folder or a .gguf file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SpecError(f"model path {path} does not exist; pass {_FOLDER_HINT} (or a pack:NAME reference "
                        "resolved with trtspec.export.packs.resolve_model)")
    if path.is_dir():
        spec, state = _load_hf_folder(path, dtype)
    else:
        spec, state = load_gguf(path, dtype)  # raises "not a GGUF file" for anything else
    check_layout(spec, state, path)
    return spec, state


def load_decoder(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Decoder:
    spec, state = load_checkpoint(path, dtype)
    return Decoder.from_state(spec, state, dtype)
