"""Read a llama.cpp GGUF file into a ModelSpec and Hugging Face-named torch weights.

The header is parsed here (GGUFFile, see why there) and the weights are dequantized with
`gguf.quants.dequantize`, the reference numpy code transformers also uses: tensor by tensor on a
few threads, each cast to the target dtype at once, so a bf16 load never holds a float32 copy of
the whole model. Two llama.cpp conventions are undone:
  * shapes: GGUF lists dims fastest-first; reversed, a tensor is [out_features, in_features]
    exactly like torch's nn.Linear weight.
  * rope layout: for the `llama` architecture (Mistral included) the converter permutes the rows of
    attn_q / attn_k so that llama.cpp's interleaved (GPT-J style) rope works; our Decoder, like HF,
    uses rotate_half (NEOX style), so the permutation is reversed (a family's `gguf_rope_permuted`).
    Qwen2, Qwen3, Qwen3-MoE, Phi-3 and Gemma 3 are stored NEOX-style.
  * names: a family's `gguf_names` (Gemma's four norms; Qwen3-MoE's router and stacked experts,
    [experts, out, in] as the Decoder keeps them; Phi-3's joined q/k/v and gate/up, split by rows).
    Gemma's norms are stored as 1 + w and read as they are (spec.norm_weights_shifted), so the
    file's values are the ones multiplied.
A file cut short (a partial download or a missing pack part) is caught from the tensor table
before any data is read, as one SpecError.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .families import FAMILIES, by_gguf
from .families.base import decoder_names
from .spec import ModelSpec, SpecError

GGUF_ARCHS = tuple(f.gguf for f in FAMILIES.values() if f.gguf)
# Arrays with one entry per token: only their length is ever needed here, and decoding 150k strings
# from the memmap costs seconds.
_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.merges")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _corrupt(path: Path, why: str) -> SpecError:
    return SpecError(f"GGUF file {path} is truncated or corrupt: {why}; re-download it (or re-assemble a "
                     "split pack: delete the cached file and resolve the pack again)")


@dataclass
class GGUFTensor:
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (GGUF's dims reversed)
    offset: int  # absolute byte offset in the file
    n_bytes: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


class GGUFFile:
    """The header of a GGUF file (metadata + tensor table) and memory-mapped access to its tensors.

    `gguf.GGUFReader` builds a numpy object for every string of the vocabulary, which takes ~15 s for
    Qwen2.5's 150k tokens + 150k merges; this parser walks the same header in well under a second
    and leaves the vocabulary to the tokenizer. Dequantization still uses `gguf.quants`."""

    def __init__(self, path: str | os.PathLike, size: int | None = None):
        """`size`: the whole file's size where `path` holds only its beginning (a pack's first part:
        enough for the header and the tensor table, never for the tensors)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path = Path(path)
        self.size = path.stat().st_size if size is None else size
        with open(path, "rb") as f:
            buf = f.read(4)
            if buf != b"GGUF":
                raise SpecError(f"{path} is not a GGUF file (it does not start with the GGUF magic); "
                                "pass a .gguf file or a Hugging Face model folder")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
            if version not in (2, 3):
                raise SpecError(f"GGUF file {path} has version {version:#x}; trtspec reads little-endian GGUF "
                                "v2/v3, re-convert it with a recent llama.cpp")
            off = 24
            for _ in range(n_kv):
                key, off = self._str(off)
                (vtype,), off = struct.unpack_from("<I", self._buf, off), off + 4
                self.metadata[key], off = self._value(off, vtype, keep=key not in _TOKEN_ARRAYS)
            infos = []
            for _ in range(n_tensors):
                name, off = self._str(off)
                (n_dims,), off = struct.unpack_from("<I", self._buf, off), off + 4
                dims, off = struct.unpack_from(f"<{n_dims}Q", self._buf, off), off + 8 * n_dims
                qtype, rel = struct.unpack_from("<IQ", self._buf, off)
                off += 12
                infos.append((name, dims, qtype, rel))
        except SpecError:
            raise
        # a cut or a corrupt length in the header shows up as any of these (lengths are checked against
        # the file's size before anything is allocated or read, so none of them allocates by a length)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, RecursionError) as e:
            raise _corrupt(path, f"the header cannot be parsed ({e})") from None
        finally:
            self._buf.close()  # only the header is read through it; tensors go through np.memmap
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-off // align) * align
        for name, dims, qtype, rel in infos:
            try:
                qtype = GGMLQuantizationType(qtype)
            except ValueError:
                raise SpecError(f"GGUF tensor {name} has quantization type {qtype}, unknown to the installed "
                                "gguf package; upgrade it (pip install -U gguf)") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = math.prod(dims) // block * type_size
            t = GGUFTensor(name, qtype, tuple(int(d) for d in reversed(dims)), data_start + rel, n_bytes)
            if t.offset + n_bytes > self.size:
                raise _corrupt(path, f"tensor {name} needs bytes up to {t.offset + n_bytes:,} but the file has "
                                     f"{self.size:,}")
            self.tensors.append(t)

    def _str(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, off)
        if off + 8 + n > len(self._buf):  # slicing an mmap past its end silently returns less
            raise ValueError(f"string at byte {off} runs past the end of the file")
        return self._buf[off + 8:off + 8 + n].decode("utf-8"), off + 8 + n

    def _value(self, off: int, vtype: int, keep: bool = True) -> tuple[Any, int]:
        if vtype == 8:
            return self._str(off)
        if vtype in _SCALARS:
            return struct.unpack_from(_SCALARS[vtype], self._buf, off)[0], off + struct.calcsize(_SCALARS[vtype])
        if vtype != 9:
            raise ValueError(f"unknown metadata value type {vtype}")
        sub, count = struct.unpack_from("<IQ", self._buf, off)
        off += 12
        if sub in _NP:  # numeric array: one numpy read
            arr = np.frombuffer(self._buf, dtype=_NP[sub], count=count, offset=off)
            return (arr.tolist() if keep else count), off + arr.nbytes
        if sub == 8 and not keep:  # skip a string array: only the lengths need reading
            for _ in range(count):
                off += 8 + struct.unpack_from("<Q", self._buf, off)[0]
            if off > len(self._buf):
                raise ValueError("a string array runs past the end of the file")
            return count, off
        items = []
        for _ in range(count):
            item, off = self._value(off, sub, keep)
            if keep:
                items.append(item)
        return (items if keep else count), off

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as the array `gguf.quants.dequantize` expects: read into memory of its
        own (a memory map would keep every page read resident in this process until the end)."""
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        data = np.fromfile(self.path, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        if t.qtype == Q.F32:
            return data.view(np.float32).reshape(t.shape)
        if t.qtype == Q.F16:
            return data.view(np.float16).reshape(t.shape)
        return data.reshape(quant_shape_to_byte_shape(t.shape, t.qtype))


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


def spec_from_gguf(gf: GGUFFile) -> ModelSpec:
    """ModelSpec from the `{arch}.*` metadata, with weight-derived facts (vocab, bias, tying) taken
    from the tensor table, which is what the weights will actually have to match."""
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise SpecError(f"unsupported GGUF architecture {arch!r} (general.architecture): trtspec reads "
                        f"{', '.join(GGUF_ARCHS)} GGUF files; pick a model of one of those families")
    shapes = {t.name: t.shape for t in gf.tensors}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise SpecError(f"GGUF metadata lacks {arch}.{key}; the file was not written by a llama.cpp "
                            "converter trtspec knows, re-convert it with a recent convert_hf_to_gguf.py")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    rotary_dim = int(rot) if rot is not None and int(rot) != head_dim else None     # partial (Phi-4-mini)
    if rotary_dim is not None and (rotary_dim % 2 or not 0 < rotary_dim < head_dim):
        raise _corrupt(gf.path, f"{arch}.rope.dimension_count is {rot} for heads of {head_dim}")
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
    fields = _family_fields(arch, meta, get, hidden, heads, head_dim)
    if "rope_factors_long.weight" in shapes:        # longrope (Phi-3): its factors as tensors
        rope_scaling = _longrope(gf, shapes, (rotary_dim or head_dim) // 2, int(get("rope.scaling.original_context_length")))
    spec = ModelSpec(
        # llama.cpp writes Mistral as `llama` (transformers tells them apart by name the same way).
        arch="mistral" if arch == "llama" and "mistral" in name.lower() else by_gguf(arch).name,
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
        rotary_dim=rotary_dim,
        extra={"source": "gguf", "gguf_arch": arch, "name": name, "eos_token_ids": sorted(eos)},
        **fields,
    )
    if "rope_freqs.weight" in shapes and rope_scaling is None:
        t = next(t for t in gf.tensors if t.name == "rope_freqs.weight")
        if t.shape != (spec.head_dim // 2,):       # checked before the rope tables (head_dim-sized) are made
            raise _corrupt(gf.path, f"rope_freqs has shape {list(t.shape)}, the metadata implies [{spec.head_dim // 2}]")
        spec.rope_scaling = _llama3_rope_from_factors(spec, _dequantize(gf, t).astype(np.float64))
    return spec


def _family_fields(arch: str, meta: dict, get, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """What a family's GGUF says beyond llama's fields, as llama.cpp reads it (phi3's files hold a
    window llama.cpp does not read, "TODO: fix conversion scripts": nor does trtspec)."""
    if arch == "qwen3moe":                 # llama.cpp renormalizes the chosen experts' weights, always
        return dict(num_experts=int(get("expert_count")), experts_per_token=int(get("expert_used_count")),
                    moe_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True)
    if arch != "gemma3":
        return {}
    if meta.get("gemma3.final_logit_softcapping"):
        raise SpecError("this Gemma GGUF soft-caps its logits, which trtspec does not support; pick a model "
                        "without final_logit_softcapping")
    layers, window = int(get("block_count")), int(meta.get("gemma3.attention.sliding_window") or 0)
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):          # one flag per layer
        windowed = [bool(p) for p in pattern]
    else:                                  # llama.cpp's set_swa_pattern: the last of every `pattern` layers is global
        windowed = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return dict(sliding_window=window or None,
                layer_types=["sliding_attention" if w else "full_attention" for w in windowed] if window else None,
                local_rope_theta=float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
                # llama.cpp's attention scale: 1 / sqrt(head_dim), the 27B's (62 layers) 1 / sqrt(hidden / heads)
                query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
                hidden_act="gelu_pytorch_tanh", norm_weights_shifted=True)


def _longrope(gf: GGUFFile, shapes: dict, half: int, original: int) -> dict[str, Any]:
    """Phi-3's longrope scaling from its `rope_factors_long` / `_short` tensors (one factor per rotary pair)."""
    for kind in ("long", "short"):
        if shapes.get(f"rope_factors_{kind}.weight") != (half,):
            raise _corrupt(gf.path, f"rope_factors_{kind} has shape {list(shapes.get(f'rope_factors_{kind}.weight', ()))}, "
                                    f"the metadata implies [{half}]")
    factors = {kind: _dequantize(gf, next(t for t in gf.tensors if t.name == f"rope_factors_{kind}.weight"))
               for kind in ("long", "short")}
    return {"rope_type": "longrope", "long_factor": factors["long"].tolist(),
            "short_factor": factors["short"].tolist(), "original_max_position_embeddings": original}


def hf_name(gguf_name: str, family=None) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name (None for tensors we do not load), in
    `family` where its names differ (Gemma's norms; Qwen3-MoE's router and stacked experts, which
    are Decoder parameters of their own, without `.weight`)."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        names = {**_LAYER_NAMES, **dict(family.gguf_names if family else ())}
        if part not in names:
            return None
        return f"model.layers.{layer}.{names[part]}" + ("" if part.endswith("_exps") else f".{kind}")
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def expected_shape(name: str, spec: ModelSpec) -> tuple[int, ...] | None:
    """The shape the spec implies for an HF-named weight: None for a name it does not know, a shape
    nothing has for a layer index past block_count."""
    h, d, v, i = spec.hidden_size, spec.head_dim, spec.vocab_size, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        return {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}.get(name)
    if int(m.group(1)) >= spec.num_layers:
        return (-1,)                        # never matches: a block the metadata does not have
    return {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,)}.get(m.group(2))


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of q/k rows (weight [heads*D, in] or bias [heads*D]).

    llama.cpp stores, per head, the rows as interleaved pairs (x0, x_{D/2}, x1, x_{D/2+1}, ...);
    reshaping to (head, D/2, 2) and swapping the last two axes restores (x0..x_{D/2-1}, x_{D/2}..)."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_ROWS = 8192             # rows dequantized at once


def _dequantize(gf: GGUFFile, t: GGUFTensor) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    raw = gf.raw(t)
    if t.qtype in (Q.F32, Q.F16):
        return raw.astype(np.float32)
    try:
        if raw.ndim != 2 or raw.shape[0] <= _ROWS:
            return dequantize(raw, t.qtype)
        # By slices of rows: gguf's numpy code makes several temporaries the size of its input's
        # output (a 150k-token embedding: ~3 GB at once); each block dequantizes alone, so the
        # slices' outputs are the whole tensor's, bit for bit.
        first = dequantize(raw[:_ROWS], t.qtype)
        out = np.empty((raw.shape[0], first.shape[1]), dtype=first.dtype)
        out[:_ROWS] = first
        for r in range(_ROWS, raw.shape[0], _ROWS):
            out[r:r + _ROWS] = dequantize(raw[r:r + _ROWS], t.qtype)
        return out
    except NotImplementedError:
        raise SpecError(f"GGUF tensor {t.name} uses quantization {t.qtype.name}, which the gguf package cannot "
                        "dequantize; use a Q4_K/Q6_K/Q8_0/F16 file or upgrade gguf (pip install -U gguf)") from None


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              threads: int | None = None) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(spec, HF-named state dict in `dtype`) for a GGUF file of a family llama.cpp and trtspec both
    read (families/: `gguf`)."""
    try:
        return _load_gguf(path, dtype, threads)
    except SpecError as e:               # messages about a key or a tensor: say which file too
        if str(path) in str(e):
            raise
        raise SpecError(f"{path}: {e}") from None


def _load_gguf(path, dtype, threads):
    gf = GGUFFile(path)
    try:
        spec = spec_from_gguf(gf)
    except SpecError:
        raise
    except (TypeError, ValueError, ArithmeticError) as e:   # a metadata value of the wrong type or range (0 heads)
        raise _corrupt(Path(path), f"a metadata value is out of range or of the wrong type ({e})") from None
    family = by_gguf(spec.extra["gguf_arch"])
    permuted = family.gguf_rope_permuted
    wanted = [(t, hf_name(t.name, family)) for t in gf.tensors]
    wanted = [(t, name) for t, name in wanted if name is not None]  # e.g. rope_freqs: folded into the spec
    parts = {name: decoder_names(spec, name) for _, name in wanted}      # Phi-3's qkv, gate/up: split by rows

    for t, name in wanted:                 # before any data is read: the table must fit the metadata
        last = parts[name][-1].rows
        expect = expected_shape(name, spec) if last is None else (last.stop, *t.shape[1:])
        if expect is not None and tuple(t.shape) != expect:
            raise _corrupt(gf.path, f"tensor {t.name} has shape {list(t.shape)}, the metadata implies {list(expect)}")

    def convert(item: tuple[GGUFTensor, str]) -> torch.Tensor:
        t, name = item
        try:
            w = torch.from_numpy(_dequantize(gf, t))
        except SpecError:
            raise
        except ValueError as e:  # a tensor table that contradicts its own quantization block sizes
            raise _corrupt(gf.path, f"tensor {t.name}: {e}") from None
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rope(w, spec.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rope(w, spec.num_kv_heads)
        return w.to(dtype).contiguous()  # the float32 copy dies here: only `threads` of them ever coexist

    # numpy's dequantization releases the GIL, so a few threads scale on the CPU cores.
    threads = threads or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        tensors = list(pool.map(convert, wanted))
    state = {}
    for (_, name), w in zip(wanted, tensors):
        state.update({p.name: w if p.rows is None else w[p.rows].clone() for p in parts[name]})
    return spec, state
