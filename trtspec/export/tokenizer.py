"""Tokenizers for target and draft models, from a Hugging Face folder or a GGUF file's metadata.

transformers rebuilds a fast tokenizer from GGUF metadata offline, but it takes ~13 s for Qwen2.5's
150k-token vocabulary, so the result is saved once (tokenizer.json etc.) to the trtspec cache and
later loads read that in about a second. Speculative decoding is only lossless when target and
draft share token ids, which `check_same_vocab` enforces.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .spec import ModelSpec, SpecError

# Chat / document end markers of the supported model families; any that is a special token of the
# tokenizer stops generation (instruct models end turns with these rather than with their eos).
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>",
                "<end_of_turn>", "<|end|>")                 # Gemma's turn end; Phi-3's
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _from_pretrained(folder: Path):
    """transformers' loader, its failures on malformed files (JSON, vocab, merges, config) as one line."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:      # noqa: BLE001 - json, tokenizers' Rust errors, KeyError, ...: any is a bad file
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise SpecError(f"the tokenizer files in {folder} cannot be loaded ({type(e).__name__}: {why}); restore "
                        "them from the model's source (or rebuild the engine folder)") from None


def _gguf_cache_folder(gguf: Path) -> Path:
    from .packs import cache_dir

    st = gguf.stat()  # keyed on size + mtime: a replaced file gets a fresh conversion
    return cache_dir() / "tokenizers" / f"{gguf.name}-{st.st_size}-{st.st_mtime_ns}"


def load_tokenizer(path: str | os.PathLike, cache: bool = True):
    """A transformers fast tokenizer from a HF folder (tokenizer.json) or a .gguf file.

    With `cache`, a GGUF's tokenizer is converted once and saved under the trtspec cache."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise SpecError(f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); download the model's "
                            "tokenizer files into it (or save one with trtspec.export.tokenizer.save_tokenizer)")
        return _from_pretrained(path)
    if not path.is_file():
        raise SpecError(f"tokenizer source {path} does not exist; pass a Hugging Face folder or a .gguf file")
    folder = _gguf_cache_folder(path) if cache else None
    if folder is not None and (folder / "tokenizer.json").is_file():
        return _from_pretrained(folder)
    from .gguf_loader import GGUFFile

    GGUFFile(path)  # clear SpecError for a truncated / non-GGUF file before transformers sees it
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if folder is not None:
        save_tokenizer(tok, folder)
    return tok


def save_tokenizer(tok, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json + config to `out_dir` atomically (a temp folder renamed into place)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError:
        if not (out / "tokenizer.json").is_file():  # losing a race to a parallel save is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_same_vocab(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """SpecError unless both tokenizers map exactly the same strings to the same ids."""
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a == b:
        return
    differ = [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
    differ.sort(key=lambda k: (min(i for i in (a.get(k), b.get(k)) if i is not None), k))
    show = lambda i: "absent" if i is None else f"id {i}"  # noqa: E731
    examples = "; ".join(f"{k!r}: {target_name} {show(a.get(k))}, {draft_name} {show(b.get(k))}" for k in differ[:3])
    raise SpecError(f"{target_name} and {draft_name} have different vocabularies ({len(a)} vs {len(b)} tokens, "
                    f"{len(differ)} differ, e.g. {examples}); speculative decoding needs identical token ids: "
                    "use a draft model trained with the same tokenizer")


def eos_token_ids(tok, spec_or_metadata: ModelSpec | dict[str, Any] | None = None) -> set[int]:
    """Token ids that end generation: the tokenizer's eos, known chat end markers that are special
    tokens of the tokenizer, and eos ids recorded by the loaders (ModelSpec.extra) or in GGUF / HF config dicts."""
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    # Only special (added) tokens count: "</s>" is an ordinary BPE token in Qwen's vocabulary, for one.
    ids.update(int(i) for i, t in tok.added_tokens_decoder.items() if t.special and t.content in _STOP_TOKENS)
    src = spec_or_metadata.extra if isinstance(spec_or_metadata, ModelSpec) else spec_or_metadata or {}
    for key in ("eos_token_ids", "eos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = src.get(key)
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple, set)) else [value]) if v is not None)
    return ids
