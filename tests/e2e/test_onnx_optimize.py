"""engines/stream.py `optimize`: onnxscript's optimizer less its SlicesSplit rule (whose time grows with
the square of a graph) gives the very graph optimize_ir gives, byte for byte, for the step graphs a
build exports: the fp64-attention and the logical-order ones, plain and with rotary as one node. If a
future onnxscript's rule starts to merge Slices of ours, or lays its passes out otherwise, this fails."""
from __future__ import annotations

import onnxscript.optimizer
import pytest
import torch

from trtspec.engines import stream
from trtspec.export.tiny import tiny_spec


@pytest.mark.parametrize("exact,fused", [(True, ()), ("logical", ("rotary",))])
def test_optimize_gives_optimize_irs_graph(exact, fused, monkeypatch):
    spec = tiny_spec("qwen2", num_layers=1)
    ours, _ = stream._export_graph(spec, torch.float32, exact, 18, False, fused)
    monkeypatch.setattr(stream, "optimize", onnxscript.optimizer.optimize_ir)
    theirs, _ = stream._export_graph(spec, torch.float32, exact, 18, False, fused)
    assert len(ours.graph.node) == len(theirs.graph.node)
    assert ours.SerializeToString() == theirs.SerializeToString()
