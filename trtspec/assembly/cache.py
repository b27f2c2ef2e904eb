"""The engine cache: `trtspec run --config` builds a config into its cache folder on first use (keyed
by the config's digest) and reuses it after."""
from __future__ import annotations

import os
from pathlib import Path

from ..engines.manifest import EngineError, verify
from .build import build_engines
from .config import Config


def cache_root() -> Path:
    return Path(os.environ.get("TRTSPEC_CACHE", Path.home() / ".cache" / "trtspec"))


def engines_for_config(cfg: Config, log=print, backend: str | None = None) -> Path:
    """The cached engine folder of `cfg` (for `backend`, default the config's), built on first use."""
    cfg = cfg.with_backend(backend)
    folder = cache_root() / "engines" / f"{cfg.name}-{cfg.digest()}"
    if (folder / "manifest.json").exists():
        try:
            verify(folder)
            return folder
        except EngineError as e:
            log(f"cached engines unusable ({e}); rebuilding")
    from .backends import BACKENDS
    from .build_need import check_build
    check_build(cfg, folder, BACKENDS[cfg.backend].onnx)      # memory and disk, before a word of progress
    log(f"building engines for {cfg.name} into {folder} (first use only)")
    # reuse: another process may finish building the same folder while this one waits for its lock
    return build_engines(cfg, folder, force=True, log=log, reuse=True, checked=True)
