"""A model's weights read one tensor at a time: what a streaming build needs instead of a Decoder.

    Weights.spec               the ModelSpec
    Weights.shapes             HF-named weight -> shape (the Decoder's layout, checked on open)
    Weights.get(name, dtype)   one tensor, dequantized / converted / unpermuted as the loaders do
    Weights.blocks(name)       the GGUF's own blocks of a weight (gguf_blocks.Blocks), or None

`open_weights` opens a Hugging Face folder (safetensors, one tensor per read) or a GGUF file (one
tensor dequantized at a time from its memory map); `StateWeights` wraps weights already in memory
(the tiny models, a torch backend's Decoder). `get` returns the same values `load_checkpoint` puts
in its state dict, tensor by tensor, so a graph written from them holds the same weights.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..export.families import by_gguf
from ..export.families.base import decoder_names
from ..export.spec import ModelSpec, SpecError


class Weights:
    spec: ModelSpec
    shapes: dict[str, tuple[int, ...]]

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self, name: str):
        """(the source's tensor name, gguf_blocks.Blocks) of a weight the source stores in blocks."""
        return None

    def qtype_name(self, name: str) -> str:
        return "dense"

    def layers(self, n: int) -> "Weights":
        """The first n layers with the model's own norm and head (`layers:` in a config)."""
        if n >= self.spec.num_layers:
            raise SpecError(f"layers: {n} must be below the model's {self.spec.num_layers} layers")
        return _Truncated(self, n)


class StateWeights(Weights):
    """Weights already in memory (an HF-named state dict)."""

    def __init__(self, spec: ModelSpec, state: dict[str, torch.Tensor]):
        self.spec, self.state = spec, state
        self.shapes = {k: tuple(v.shape) for k, v in state.items() if not _tied(spec, k)}

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.state[name].to(dtype).contiguous()


class GGUFWeights(Weights):
    def __init__(self, path: Path):
        from ..export.gguf_loader import GGUFFile, _corrupt, expected_shape, hf_name, spec_from_gguf
        self.file = GGUFFile(path)
        try:
            self.spec = spec_from_gguf(self.file)
        except SpecError:
            raise
        except (TypeError, ValueError, ArithmeticError) as e:
            raise _corrupt(Path(path), f"a metadata value is out of range or of the wrong type ({e})") from None
        family = by_gguf(self.spec.extra["gguf_arch"])
        self.tensors, self.slices = {}, {}       # name -> its GGUF tensor (and its rows of it: Phi-3's joined ones)
        for t in self.file.tensors:
            if (joined := hf_name(t.name, family)) is None:
                continue
            parts = decoder_names(self.spec, joined)          # Phi-3's joined ones: split by rows
            expect = expected_shape(joined, self.spec) if parts[-1].rows is None else (parts[-1].rows.stop, *t.shape[1:])
            if expect is not None and tuple(t.shape) != expect:   # before any data is read: the table must fit
                raise _corrupt(self.file.path, f"tensor {t.name} has shape {list(t.shape)}, the metadata implies "
                                               f"{list(expect)}")
            for p in parts:
                self.tensors[p.name] = t
                if p.rows is not None:
                    self.slices[p.name] = p.rows
        self.shapes = {k: (self.slices[k].stop - self.slices[k].start, *t.shape[1:]) if k in self.slices else
                       tuple(t.shape) for k, t in self.tensors.items() if not _tied(self.spec, k)}

    def _rows(self, name: str):
        from ..export.gguf_loader import unpermute_rope
        heads = (self.spec.num_heads if ".self_attn.q_proj." in name else
                 self.spec.num_kv_heads if ".self_attn.k_proj." in name else 0)
        if self.spec.extra["gguf_arch"] != "llama" or not heads:
            return None
        return lambda w: unpermute_rope(w, heads)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        from ..export.gguf_loader import _corrupt, _dequantize
        t = self.tensors[name]
        try:
            w = torch.from_numpy(_dequantize(self.file, t))
        except ValueError as e:
            raise _corrupt(self.file.path, f"tensor {t.name}: {e}") from None
        if name in self.slices:
            w = w[self.slices[name]]
        if (perm := self._rows(name)) is not None:
            w = perm(w)
        return w.to(dtype).contiguous()

    def qtype_name(self, name: str) -> str:
        return self.tensors[name].qtype.name

    def blocks(self, name: str):
        """(GGUF tensor name, its blocks in the model's row order), checked to decode to exactly
        what `get` returns; None for a type kept dense. Stacked experts [E, N, K] come as E * N rows."""
        from .gguf_blocks import decode
        t = self.tensors[name]
        bl = decode(self.file.raw(t), t.qtype, (int(np.prod(t.shape[:-1])), t.shape[-1])) if len(t.shape) in (2, 3) \
            else None
        if bl is None:
            return None
        if name in self.slices:
            bl = bl.rows(np.arange(self.slices[name].start, self.slices[name].stop))
        if (perm := self._rows(name)) is not None:
            bl = bl.rows(perm(torch.arange(t.shape[0])).numpy())
        w = self.get(name, torch.float32).numpy().reshape(bl.codes.shape)
        for r in range(0, w.shape[0], 4096):      # in slices: the whole dequantized copy would double the peak
            part = bl.rows(np.arange(r, min(r + 4096, w.shape[0]))).dequantize()
            if not np.array_equal(part.view(np.uint32), w[r:r + 4096].view(np.uint32)):
                break
        else:       # a piece of a joined tensor (Phi-3's) is named by its rows: blk.0.attn_qkv.weight[0:64]
            sl = self.slices.get(name)
            return (t.name if sl is None else f"{t.name}[{sl.start}:{sl.stop}]"), bl
        raise RuntimeError(f"{self.file.path}: tensor {t.name} ({t.qtype.name}) decodes differently from "
                           "gguf.quants.dequantize; this gguf release changed the format: report it")


class SafetensorsWeights(Weights):
    def __init__(self, folder: Path):
        from safetensors import safe_open

        from ..export.checkpoint import _hf_eos_ids, _safetensors_files
        config = folder / "config.json"
        if not config.is_file():
            raise SpecError(f"{folder} has no config.json, so it is not a Hugging Face model folder; pass a Hugging "
                            "Face model folder (config.json + *.safetensors) or a .gguf file")
        cfg = json.loads(config.read_text())
        self.spec = ModelSpec.from_hf_config(cfg)
        self.spec.extra.update(source="hf", name=cfg.get("_name_or_path") or folder.name,
                               eos_token_ids=sorted(_hf_eos_ids(folder, cfg)))
        self.where, self.shapes = {}, {}     # name -> (file, the tensor holding it, its rows or None)
        for file in _safetensors_files(folder):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    # renamed (a multimodal checkpoint's language model), split (Phi-3's joined ones), or none
                    parts = [p for p in decoder_names(self.spec, key)
                             if not (p.name.endswith("rotary_emb.inv_freq") or _tied(self.spec, p.name))]
                    if not parts:
                        continue
                    shape = tuple(f.get_slice(key).get_shape())
                    for p in parts:
                        if p.expert is not None:          # one expert of a stacked tensor (Qwen3-MoE)
                            self.where.setdefault(p.name, {})[p.expert] = (file, key, None)
                            self.shapes[p.name] = (self.spec.num_experts, *shape)
                        else:
                            self.where[p.name] = (file, key, p.rows)
                            self.shapes[p.name] = shape if p.rows is None else (p.rows.stop - p.rows.start, *shape[1:])

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        from safetensors import safe_open
        where = self.where[name]
        if isinstance(where, dict):           # the experts' weights, stacked by index, each file opened once
            out = torch.empty(self.shapes[name], dtype=dtype)
            for file in {w[0] for w in where.values()}:
                with safe_open(file, framework="pt") as f:
                    for i, (_, key, _) in ((i, w) for i, w in where.items() if w[0] == file):
                        out[i] = f.get_tensor(key)
            return out
        file, key, rows = where
        with safe_open(file, framework="pt") as f:
            t = f.get_tensor(key) if rows is None else f.get_slice(key)[rows]
            return t.to(dtype).contiguous()


class _Truncated(Weights):
    def __init__(self, base: Weights, n: int):
        self.base, self.spec = base, base.spec.first_layers(n)
        self.shapes = {k: s for k, s in base.shapes.items() if in_first_layers(k, n)}

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.base.get(name, dtype)

    def blocks(self, name: str):
        return self.base.blocks(name)

    def qtype_name(self, name: str) -> str:
        return self.base.qtype_name(name)


class HeadRows(Weights):
    """The weights with an LM head (`HEAD`) over the rows `ids` only: a draft's reduced-vocabulary
    head (engines/head_vocab.py), read from the model's head, or its embedding when the two are tied."""
    HEAD = "lm_head.weight"

    def __init__(self, base: Weights, ids: np.ndarray):
        self.base, self.ids, self.spec, self.shapes = base, ids, base.spec, base.shapes
        self.source = "model.embed_tokens.weight" if _tied(base.spec, self.HEAD) else self.HEAD

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name != self.HEAD:
            return self.base.get(name, dtype)
        return self.base.get(self.source, dtype)[torch.from_numpy(self.ids)].contiguous()

    def blocks(self, name: str):
        if name != self.HEAD:
            return self.base.blocks(name)
        found = self.base.blocks(self.source)
        return None if found is None else (found[0], found[1].rows(self.ids))

    def qtype_name(self, name: str) -> str:
        return self.base.qtype_name(self.source if name == self.HEAD else name)


def in_first_layers(key: str, n: int) -> bool:
    """Whether an HF-named weight belongs to a model cut to its first n layers (`layers:`)."""
    return not (key.startswith("model.layers.") and int(key.split(".")[2]) >= n)


def _tied(spec: ModelSpec, key: str) -> bool:
    return spec.tie_word_embeddings and key == "lm_head.weight"


def open_weights(path: str | os.PathLike) -> Weights:
    """The weights of a Hugging Face folder or a .gguf file, checked against the Decoder's layout
    before any tensor is read."""
    from ..export.checkpoint import _FOLDER_HINT, check_layout
    path = Path(path).expanduser()
    if not path.exists():
        raise SpecError(f"model path {path} does not exist; pass {_FOLDER_HINT}")
    try:
        w = SafetensorsWeights(path) if path.is_dir() else GGUFWeights(path)
    except SpecError as e:
        if str(path) in str(e):
            raise
        raise SpecError(f"{path}: {e}") from None
    check_layout(w.spec, {k: torch.empty(s, device="meta") for k, s in w.shapes.items()}, path)
    return w


def describe(ref: str) -> tuple[ModelSpec, dict[str, tuple[tuple[int, ...], str]]]:
    """(spec, HF-named weight -> (shape, storage type: a GGUF block type or a dtype)) of a model
    reference, from headers only: nothing assembled, dequantized or loaded (the build's checks)."""
    from ..export.gguf_loader import GGUFFile, hf_name, spec_from_gguf
    from ..export.packs import source_files
    files, _ = source_files(ref)
    if not files and not str(ref).startswith("pack:") and not Path(ref).expanduser().exists():
        raise SpecError(f"model path {Path(ref).expanduser()} does not exist; put the model's Hugging Face folder "
                        "(config.json + *.safetensors) or .gguf file there, or point the config's model: at yours")
    if not files:
        raise SpecError(f"model {ref} has no weight files")
    if files[0].suffix != ".safetensors":
        gf = GGUFFile(files[0], size=sum(f.stat().st_size for f in files))
        spec = spec_from_gguf(gf)
        family = by_gguf(spec.extra["gguf_arch"])
        table = {}
        for t in gf.tensors:
            if (joined := hf_name(t.name, family)) is not None:
                for p in decoder_names(spec, joined):                   # Phi-3's joined ones: split by rows
                    if not _tied(spec, p.name):
                        rows = t.shape[0] if p.rows is None else p.rows.stop - p.rows.start
                        table[p.name] = ((rows, *t.shape[1:]), t.qtype.name)
        return spec, table
    w = SafetensorsWeights(files[0].parent)
    from safetensors import safe_open
    table = {}
    for name, where in w.where.items():
        file, key, _ = where[0] if isinstance(where, dict) else where       # experts: the first one's dtype
        with safe_open(file, framework="pt") as f:
            table[name] = (w.shapes[name], f.get_slice(key).get_dtype())
    return w.spec, table
