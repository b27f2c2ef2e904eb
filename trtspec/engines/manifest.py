"""manifest.json: what an engine folder holds and proof that it is intact.

It records the config, each model's spec and I/O contract, the tokenizer files, the versions of
trtspec/torch/onnx/onnxruntime/tensorrt that built it, and the sha256 of every artifact. `verify`
refuses a folder whose manifest is missing, of a contract version this trtspec does not run
(export/contract.py: READS), or whose files differ. Hashing gigabytes on every run would cost
seconds, so a verified hash is remembered in `.verified.json` against the file's size and mtime;
any rewrite of the file changes those.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import TrtspecError
from ..export.contract import CONTRACT_VERSION, GRAPH_REVISION, READS
from ..runtime.costs import COSTS_FILE

FORMAT = "trtspec-engine"
MANIFEST = "manifest.json"
VERIFIED = ".verified.json"

log = logging.getLogger(__name__)


class EngineError(TrtspecError, RuntimeError):
    """An engine folder or backend that cannot be used here; the message says how to rebuild."""


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("trtspec", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def write_manifest(folder: Path, content: dict[str, Any]) -> dict[str, Any]:
    """Hash every file under `folder` and write manifest.json (content + files + versions)."""
    # costs.json (runtime/costs.py) describes the machine, not the build: measured again freely.
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, VERIFIED, COSTS_FILE))
    manifest = {
        "format": FORMAT,
        "contract_version": CONTRACT_VERSION,
        "graph_revision": GRAPH_REVISION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        **content,
        "files": {p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                  for p in files},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


class _File(BaseModel):
    sha256: str
    bytes: Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")
    spec: dict
    dtype: Literal["fp32", "fp16", "bf16"]
    artifacts: dict[str, str]


class _Manifest(BaseModel):
    model_config = ConfigDict(extra="allow")
    contract_version: int
    graph_revision: int = 1
    backend: Literal["torch", "onnxruntime", "tensorrt"] | None = None
    files: dict[str, _File]
    models: dict[str, _Model]          # roles: target, draft, and head roles (kind: head)
    config: dict
    tokenizer: str
    stop_ids: list[int] = []


def is_head(info: dict) -> bool:
    """Whether a manifest's model entry is a head role (export/head.py): no KV cache, run by torch on
    every backend."""
    return info.get("kind") == "head"


def _check_shape(manifest: dict, path: Path, fix: str) -> None:
    """EngineError unless the manifest has the fields and types the loaders read (a hand-edited or
    corrupted one must fail here, in one line, not as a KeyError deep in loading)."""
    from ..export.head import HeadSpec
    from ..export.spec import ModelSpec
    try:
        m = _Manifest.model_validate(manifest)
        if "target" not in m.models:
            raise ValueError("models has no target")
        for role, model in m.models.items():
            if (role in ("target", "draft")) == (getattr(model, "kind", None) == "head"):
                raise ValueError(f"model {role!r} is neither the target, the draft nor a head")
        for rel in list(m.files) + [a for model in m.models.values() for a in model.artifacts.values()] + [m.tokenizer]:
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"path {rel!r} leaves the folder")
        for model in m.models.values():
            missing = [a for a in model.artifacts.values() if a not in m.files]
            if missing:
                raise ValueError(f"artifact {missing[0]} is not among the hashed files")
            (HeadSpec if getattr(model, "kind", None) == "head" else ModelSpec).from_dict(model.spec)
    except (ValidationError, ValueError, TypeError, KeyError) as e:
        why = " ".join(str(e).split())[:300]
        raise EngineError(f"{path} is malformed ({why}); {fix}") from None


def verify(folder: str | Path) -> dict[str, Any]:
    """Return the manifest of an intact engine folder; raise EngineError naming the problem and fix."""
    folder = Path(folder)
    fix = f"rebuild it: trtspec build --config CONFIG --output {folder}"
    if not folder.is_dir():
        raise EngineError(f"engine folder {folder} does not exist; build one first: "
                          f"trtspec build --config CONFIG --output {folder}")
    path = folder / MANIFEST
    if not path.exists():
        raise EngineError(f"{folder} has no {MANIFEST}: it is not a trtspec engine folder (or its build did "
                          f"not finish); {fix}")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:          # JSONDecodeError, bad UTF-8, nesting too deep
        raise EngineError(f"{path} is not valid JSON ({' '.join(str(e).split())[:200]}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineError(f"{path} is not a trtspec manifest; {fix}")
    _check_shape(manifest, path, fix)
    if manifest.get("contract_version") not in READS:          # v3: a v4 folder without hidden rows
        raise EngineError(f"{folder} was built for step contract v{manifest.get('contract_version')}, this "
                          f"trtspec runs v{' and v'.join(map(str, READS))}; {fix}")
    if manifest.get("graph_revision", 1) < GRAPH_REVISION:
        log.warning("%s was built with an older graph whose attention copies each layer's past every step "
                    "(it runs, more slowly at long contexts); %s", folder, fix)
    cache_path = folder / VERIFIED
    try:
        seen = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        seen = {}
    if not isinstance(seen, dict):           # a damaged cache of verified hashes: hash again
        seen = {}
    changed = False
    for rel, info in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            raise EngineError(f"{folder}: file {rel} listed in the manifest is missing; {fix}")
        st = p.stat()
        if st.st_size != info["bytes"]:
            raise EngineError(f"{folder}: {rel} has {st.st_size} bytes, the manifest says {info['bytes']} "
                              f"(truncated or modified); {fix}")
        stamp = [st.st_size, st.st_mtime_ns, info["sha256"]]
        if seen.get(rel) == stamp:
            continue
        if sha256_file(p) != info["sha256"]:
            raise EngineError(f"{folder}: {rel} does not match its sha256 in the manifest (modified or "
                              f"corrupted); {fix}")
        seen[rel], changed = stamp, True
    if changed:
        try:
            tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")    # replicas may verify one folder at once
            tmp.write_text(json.dumps(seen))
            os.replace(tmp, cache_path)
        except OSError:
            pass  # a read-only engine folder is fine: we just hash again next time
    return manifest
