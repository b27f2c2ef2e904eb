"""GraphedTorchEngine: the torch engine with one CUDA graph per bucketed step shape.

With ModelRunner buckets every step has one of a few shapes (B, T, C+T, R). For each shape, made
lazily on first use: a StagedBucket (static inputs, the batch's past, the new rows, the logits, and
the hidden rows of a model that returns them) and a function that runs the Decoder on those
buffers only. A step copies its inputs and each row's past into the bucket, replays, and scatters
the new rows into the rows' slots. Warm-up and capture run on the staging buffers, never on a live
cache row.

Where capture is impossible (no CUDA device, or an op that cannot be captured) the same function
runs eagerly on the same static buffers and the reason is logged once: the bucket/static-buffer
machinery is the same either way, which is how it is tested on CPU. CUDA capture itself is not
exercised in this repository's CI (no GPU).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..export.model import Decoder
from ..runtime.kv_cache import KVCache
from .exact import matmul_flags
from .staging import StagedBucket
from .torch_engine import TorchEngine

log = logging.getLogger("trtspec.graphs")


class GraphedTorchEngine(TorchEngine):
    name = "torch-graphs"
    logits_in_own_buffer = True

    def __init__(self, model: Decoder, device: str = "cuda", warmup: int = 2):
        super().__init__(model, device)
        self.warmup = warmup
        self.graphs: dict[tuple, StagedBucket] = {}
        self.fallback_reason: str | None = None
        if not (str(device).startswith("cuda") and torch.cuda.is_available()):
            self.fallback_reason = "CUDA graphs need a CUDA device; steps run eagerly on static buffers"
            log.info(self.fallback_reason)

    @torch.inference_mode()
    def step_batch(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        (b, t), total, r = input_ids.shape, attn_mask.shape[2], logit_rows.shape[1]
        key = (b, t, total, r)
        with matmul_flags(self.exact):                # the kernels a capture records, or an eager run picks
            g = self.graphs.get(key) or self._make(key)
            self.check_room(caches, t)
            g.load(caches, input_ids, position_ids, attn_mask, logit_rows)
            g.graph()
        g.runs += 1
        g.scatter_new_kv(caches)
        self.hidden = g.hidden                       # the bucket's own buffer, like the logits
        return g.logits

    def _make(self, key: tuple) -> StagedBucket:
        b, t, total, r = key
        g = StagedBucket.make(self.spec, self.kv_dtype, self.device, b, t, total, r, hidden=self.hidden_rows)
        x = g.inputs

        def body() -> None:
            logits, new_kv, *hidden = self.model(x["input_ids"], x["position_ids"], x["attn_mask"],
                                                 x["logit_rows"], list(g.past))
            torch.stack(new_kv, out=g.new_kv)
            g.logits.copy_(logits)
            if hidden:
                g.hidden.copy_(hidden[0])

        g.graph = body if self.fallback_reason is not None else self._capture(body, key)
        self.graphs[key] = g
        return g

    def _capture(self, body: Callable[[], None], key: tuple) -> Callable[[], None]:
        try:
            return capture(body, self.warmup)
        except Exception as e:                           # an op that cannot be captured
            log.warning("CUDA graph capture failed for step shape %s (%s: %s); running eagerly",
                        key, type(e).__name__, e)
            return body


def capture(body: Callable[[], object], warmup: int = 2) -> Callable[[], None]:
    """`body` captured as a CUDA graph; returns its replay. Warmed up on a side stream first, as
    torch requires. Raises where capture fails (the caller decides what runs instead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay
