"""bench's ONNX Runtime GenAI peers (tools/ortgenai_peers.py) on the tiny folder: built from the
folder's own target weights by ONNX Runtime GenAI's builder, the fp32 build decodes exactly our
`ar` tokens (the same model on the same engine: backend parity), the int4 build decodes the asked
number of tokens, a sampled run is reproduced by its seed, and closing the peers leaves nothing on
disk."""
from __future__ import annotations

from pathlib import Path

import pytest

from trtspec.assembly.build import build_engines
from trtspec.assembly.config import load_config
from trtspec.assembly.load import load_generator

pytest.importorskip("onnxruntime_genai")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("og") / "tiny"
    return build_engines(load_config("tiny-random"), out, backend="torch", log=lambda *a, **k: None)


def test_ortgenai_fp32_equals_our_ar_and_leaves_nothing_behind(folder, tmp_path):
    from trtspec.tools.ortgenai_peers import OrtGenAIPeers
    with load_generator(folder) as gen:
        prompts = [gen.tokenizer(t)["input_ids"] for t in ("def f(x):", "import numpy as np\n", "hello world")]
        refs = [gen.generate(ids, strategy="ar", max_new_tokens=16, ignore_eos=True).token_ids for ids in prompts]
    peers = OrtGenAIPeers(folder, ["ortgenai-fp32", "ortgenai"], threads=2, log_dir=tmp_path / "logs")
    built = Path(peers.tmp.name)
    try:
        assert sorted(p.name for p in built.iterdir()) == ["ortgenai", "ortgenai-fp32"]    # the HF copy is gone
        for ids, ref in zip(prompts, refs):
            tokens, stats = peers.run("ortgenai-fp32", ids, 16)
            assert tokens == ref
            assert stats["new_tokens"] == 16 and stats["prefill_seconds"] > 0 and stats["tokens_per_s"] > 0
            q4, _ = peers.run("ortgenai", ids, 16)
            assert len(q4) == 16 and all(0 <= t < 512 for t in q4)
        sampled = [peers.run("ortgenai-fp32", prompts[0], 16, temperature=1.0, seed=s)[0] for s in (7, 7, 8)]
        assert len(sampled[0]) == 16 and sampled[0] == sampled[1]              # a seed reproduces its draw
        assert set(peers.settings()["build"]) == {"ortgenai", "ortgenai-fp32"}
    finally:
        peers.close()
    assert not built.exists()


def test_an_unknown_ortgenai_peer_is_refused_before_any_build(folder, tmp_path):
    from trtspec.errors import RequestError
    from trtspec.tools.ortgenai_peers import OrtGenAIPeers
    with pytest.raises(RequestError, match="unknown peer"):
        OrtGenAIPeers(folder, ["ortgenai-int8"], threads=2, log_dir=tmp_path)
