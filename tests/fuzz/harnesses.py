"""Fuzz targets: what trtspec parses from files a user hands it.

Each target takes the fuzzer's bytes, writes them where the loader reads, and calls the loader. The
contract under test: a malformed input ends in the project's one-line error (`TrtspecError`) naming
the file, or loads. Anything else (another exception, a hang, memory that grows with a length field
read from the file) is a crash. `python -m tests.fuzz.run TARGET` runs one under atheris; tests/e2e/test_fuzz.py
replays the seeds and every crash found so far, and runs each target briefly.

    gguf        the GGUF header parser and loader (export/gguf_loader.py)
    manifest    an engine folder's manifest.json (engines/manifest.verify, assembly/load.open_folder)
    costs       an engine folder's costs.json (runtime/costs.load)
    config      a YAML config (config.load_config)
    tokenizer   a Hugging Face tokenizer folder's tokenizer.json / tokenizer_config.json (export/tokenizer.load_tokenizer)
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

from trtspec.errors import TrtspecError

# One scratch folder per process, rewritten per input: run.py's (it removes it), else our own.
WORK = Path(os.environ.get("TRTSPEC_FUZZ_WORK") or tempfile.mkdtemp(prefix="trtspec-fuzz-"))
if "TRTSPEC_FUZZ_WORK" not in os.environ:
    atexit.register(shutil.rmtree, WORK, ignore_errors=True)
TEMPLATE = WORK / "template"                            # a real (tiny, torch) engine folder, built once


class BadError(AssertionError):
    """A TrtspecError that breaks the one-line contract (several lines, or no file named)."""


def _check(e: TrtspecError, names: tuple[str, ...]) -> None:
    msg = str(e)
    if "\n" in msg:
        raise BadError(f"multi-line error: {msg!r}")
    if not any(n in msg for n in names):
        raise BadError(f"error does not name the file ({names}): {msg!r}")


def gguf(data: bytes) -> None:
    from trtspec.export.gguf_loader import load_gguf
    path = WORK / "fuzz.gguf"
    path.write_bytes(data)
    try:
        load_gguf(path, threads=1)
    except TrtspecError as e:
        _check(e, (str(path),))


def template() -> Path:
    """A tiny torch engine folder (built on first use in this process)."""
    if not (TEMPLATE / "manifest.json").exists():
        from trtspec.assembly.config import load_config
        from trtspec.assembly.build import build_engines
        build_engines(load_config("tiny-random"), TEMPLATE, backend="torch", log=lambda *a, **k: None)
    return TEMPLATE


def _folder() -> Path:
    folder = WORK / "engines"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(template(), folder)
    return folder


def manifest(data: bytes) -> None:
    from trtspec.assembly.load import open_folder
    folder = _folder()
    (folder / "manifest.json").write_bytes(data)
    try:
        open_folder(folder)
    except TrtspecError as e:
        _check(e, (str(folder),))


def costs(data: bytes) -> None:
    from trtspec.runtime.costs import load
    folder = WORK / "costs"
    folder.mkdir(exist_ok=True)
    (folder / "costs.json").write_bytes(data)
    model = load(folder)              # None (measured again) or a model whose lookups work
    if model is not None:
        model.describe()
        for role in ("target", "draft"):
            if role == "target" or model.draft is not None:
                model.forward(role, [1, 4], 100.0)


def config(data: bytes) -> None:
    from trtspec.assembly.config import load_config
    path = WORK / "fuzz.yaml"
    path.write_bytes(data)
    try:
        load_config(str(path))
    except TrtspecError as e:
        _check(e, (str(path), path.name))


def tokenizer(data: bytes) -> None:
    """The first byte picks the file the rest replaces in a copy of the template's tokenizer folder."""
    from trtspec.export.tokenizer import load_tokenizer
    folder = WORK / "tokenizer"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(template() / "tokenizer", folder)
    name = ("tokenizer.json", "tokenizer_config.json")[data[0] % 2] if data else "tokenizer.json"
    (folder / name).write_bytes(data[1:])
    try:
        tok = load_tokenizer(folder)
        tok("def f(x): return x")          # a tokenizer that loads must also tokenize
    except TrtspecError as e:
        _check(e, (str(folder),))


TARGETS = {"gguf": gguf, "manifest": manifest, "costs": costs, "config": config, "tokenizer": tokenizer}
MODULES = {"gguf": ["trtspec.export.gguf_loader"], "manifest": ["trtspec.engines.manifest", "trtspec.assembly.load"],
           "costs": ["trtspec.runtime.costs"], "config": ["trtspec.assembly.config", "trtspec.options"],
           "tokenizer": ["trtspec.export.tokenizer"]}
CRASHES = Path(__file__).resolve().parent / "crashes"     # CRASHES/TARGET/*: every crash found, replayed by tests


def tiny_gguf() -> bytes:
    """A valid 1-layer llama GGUF of ~8 KB (Q8_0 matrices, f32 norms): the GGUF seed."""
    import gguf as g
    import numpy as np
    rng = np.random.default_rng(0)
    hidden, inter, vocab, heads, kv = 32, 32, 16, 4, 2
    path = WORK / "seed.gguf"
    w = g.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_eos_token_id(2)
    d = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "blk.0.attn_q.weight": (hidden, hidden),
              "blk.0.attn_k.weight": (kv * d, hidden), "blk.0.attn_v.weight": (kv * d, hidden),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_gate.weight": (inter, hidden),
              "blk.0.ffn_up.weight": (inter, hidden), "blk.0.ffn_down.weight": (hidden, inter)}
    for name, shape in shapes.items():
        q = g.quants.quantize(rng.standard_normal(shape).astype(np.float32), g.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=g.GGMLQuantizationType.Q8_0)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def seed_inputs() -> dict[str, list[bytes]]:
    """Valid inputs of each kind, made fresh from what the project ships and builds: the fuzzer
    mutates these, and the tests check each still loads."""
    from trtspec.runtime.costs import CostModel, CostTable
    folder = template()
    table = CostTable([1, 2, 4, 8], [64, 512], [[0.1, 0.12, 0.15, 0.2], [0.12, 0.14, 0.18, 0.25]])
    return {
        "gguf": [tiny_gguf()],
        "manifest": [(folder / "manifest.json").read_bytes()],
        "costs": [json.dumps(CostModel(table, table, {"key": {}}, {"target": {2: table}}).to_dict()).encode()],
        "config": [p.read_bytes() for p in sorted((Path(__file__).resolve().parents[2] / "trtspec/configs").glob("*.yaml"))],
        "tokenizer": [b"\x00" + (folder / "tokenizer" / "tokenizer.json").read_bytes(),
                      b"\x01" + (folder / "tokenizer" / "tokenizer_config.json").read_bytes()],
    }
