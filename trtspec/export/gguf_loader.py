"""Read a llama.cpp GGUF file into a ModelSpec and Hugging Face-named torch weights.

Weights are dequantized with `gguf.quants.dequantize` (the reference numpy code that transformers
also uses), one tensor at a time and cast to the target dtype straight away, so a bf16 load never
holds a float32 copy of the whole model. Two llama.cpp conventions are undone here:
  * numpy shapes: GGUF lists dims fastest-first; `GGUFReader` already reverses them, so a
    dequantized tensor is [out_features, in_features] exactly like torch's nn.Linear weight.
  * rope layout: for the `llama` architecture (Mistral included) the converter permutes the rows of
    attn_q / attn_k so that llama.cpp's interleaved (GPT-J style) rope works; our Decoder, like HF,
    uses rotate_half (NEOX style), so the permutation is reversed. Qwen2 is stored NEOX-style.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .spec import ModelSpec, SpecError

GGUF_ARCHS = ("llama", "qwen2")
# Arrays with one entry per token: only their length is ever needed here, and decoding 150k strings
# from the memmap costs seconds.
_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.merges")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _corrupt(path: Path, why: str) -> SpecError:
    return SpecError(f"GGUF file {path} is truncated or corrupt: {why}; re-download it (or re-assemble a "
                     "split pack: delete the cached file and resolve the pack again)")


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` (memory-mapped; nothing is read yet), or one clear SpecError."""
    import gguf

    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SpecError(f"{path} is not a GGUF file (it does not start with the GGUF magic); "
                            "pass a .gguf file or a Hugging Face model folder")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a cut-off header fails in many ways (IndexError, reshape errors, ...)
        raise _corrupt(path, f"{type(e).__name__}: {e}") from None
    # The reader slices the memmap lazily, so a cut in the tensor data must be checked by hand.
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise _corrupt(path, f"tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes:,} "
                                 f"but the file has {size:,}")
    return reader


def gguf_metadata(reader) -> dict[str, Any]:
    """Metadata as plain Python values; the per-token arrays are replaced by their length."""
    meta = {}
    for key, field in reader.fields.items():
        meta[key] = len(field.data) if key in _TOKEN_ARRAYS else field.contents()
    return meta


def _llama3_rope_from_factors(spec: ModelSpec, factors: np.ndarray) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1-style rope scaling as a `rope_freqs` tensor of divisors instead of
    metadata; find the standard llama3 parameters that reproduce it (ours only knows the formula)."""
    from .model import rope_inv_freq

    base = rope_inv_freq(spec)
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        for old in (8192, 4096, 16384):
            rs = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": old}
            scaled = rope_inv_freq(ModelSpec(**{**spec.to_dict(), "rope_scaling": rs}))
            if np.allclose(base.numpy() / factors, scaled.numpy(), rtol=1e-4):
                return rs
    raise SpecError("this GGUF has a rope_freqs tensor that matches no llama3 rope scaling trtspec knows; "
                    "use the Hugging Face checkpoint of this model instead")


def spec_from_gguf(reader, meta: dict[str, Any] | None = None) -> ModelSpec:
    meta = meta if meta is not None else gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise SpecError(f"unsupported GGUF architecture {arch!r} (general.architecture): trtspec reads "
                        f"{', '.join(GGUF_ARCHS)} GGUF files; pick a Llama, Mistral or Qwen2 model")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise SpecError(f"GGUF metadata lacks {arch}.{key}; the file was not written by a llama.cpp "
                            "converter trtspec knows, re-convert it with a recent convert_hf_to_gguf.py")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise SpecError(f"GGUF rotates {rot} of {head_dim} head dims (partial rope), which trtspec does not "
                        "support; pick a model with full rotary embeddings")
    vocab = shapes.get("token_embd.weight", (meta.get("tokenizer.ggml.tokens"),))[0]
    rope_scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        rope_scaling = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            rope_scaling["original_max_position_embeddings"] = int(
                meta[f"{arch}.rope.scaling.original_context_length"])
    eos = {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if k in meta}
    name = str(meta.get("general.name") or "")
    spec = ModelSpec(
        # llama.cpp writes Mistral as `llama` (transformers tells them apart by name the same way).
        arch="mistral" if arch == "llama" and "mistral" in name.lower() else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in shapes,
        tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        extra={"source": "gguf", "gguf_arch": arch, "name": name, "eos_token_ids": sorted(eos)},
    )
    if "rope_freqs.weight" in shapes and rope_scaling is None:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        spec.rope_scaling = _llama3_rope_from_factors(spec, np.asarray(t.data, dtype=np.float64))
    return spec


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name (None for tensors we do not load)."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of q/k rows (weight [heads*D, in] or bias [heads*D]).

    llama.cpp stores, per head, the rows as interleaved pairs (x0, x_{D/2}, x1, x_{D/2+1}, ...);
    reshaping to (head, D/2, 2) and swapping the last two axes restores (x0..x_{D/2-1}, x_{D/2}..)."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter permutation (the inverse of `unpermute_rope`); used to write test files."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d_half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if tensor.tensor_type in (Q.F32, Q.F16):
        return np.array(tensor.data, dtype=np.float32)  # a writable copy out of the read-only memmap
    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise SpecError(f"GGUF tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which the gguf "
                        "package cannot dequantize; use a Q4_K/Q6_K/Q8_0/F16 file or upgrade `gguf`") from None


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(spec, HF-named state dict in `dtype`) for a llama/qwen2 GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    spec = spec_from_gguf(reader)
    permuted = spec.extra["gguf_arch"] == "llama"
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs, already folded into spec.rope_scaling
        try:
            w = torch.from_numpy(_dequantize(t))
        except (ValueError, IndexError) as e:
            raise _corrupt(path, f"tensor {t.name}: {e}") from None
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rope(w, spec.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rope(w, spec.num_kv_heads)
        state[name] = w.to(dtype).contiguous()  # one float32 tensor alive at a time
    return spec, state
