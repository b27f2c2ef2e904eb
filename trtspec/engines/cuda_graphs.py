"""GraphedTorchEngine: the torch engine with one CUDA graph per step shape.

With ModelRunner buckets, every step has one of a few shapes (T, C+T, R). For each shape, captured
lazily on first use: static input buffers, a function that runs the Decoder over the fixed past view
`buf[:, :, :C]` and writes the new KV rows into the cache with `index_copy_` at a static slot index
(so the write is inside the graph too), and a static logits buffer. A step copies its inputs into
the static buffers and replays. Graphs are per cache buffer, so target and draft never share one.

Where capture is impossible (no CUDA device, or an op that cannot be captured) the same function
runs eagerly on the same static buffers and the reason is logged once: the bucket/static-buffer
machinery is the same either way, which is how it is tested on CPU. CUDA capture itself is not
exercised in this repository's CI (no GPU).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..export.model import Decoder
from ..runtime.kv_cache import KVCache
from .torch_engine import TorchEngine

log = logging.getLogger("trtspec.graphs")


@dataclass
class StepGraph:
    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    slot: torch.Tensor           # cache rows the new KV goes to (used .. used+T)
    logits: torch.Tensor
    run: Callable[[], None] = field(default=lambda: None)
    replays: int = 0


class GraphedTorchEngine(TorchEngine):
    name = "torch-graphs"

    def __init__(self, model: Decoder, device: str = "cuda", warmup: int = 2):
        super().__init__(model, device)
        self.warmup = warmup
        self.graphs: dict[tuple, StepGraph] = {}
        self.fallback_reason: str | None = None
        if not (str(device).startswith("cuda") and torch.cuda.is_available()):
            self.fallback_reason = "CUDA graphs need a CUDA device; steps run eagerly on static buffers"
            log.info(self.fallback_reason)

    @torch.inference_mode()
    def step(self, cache: KVCache, input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        t, r = input_ids.shape[0], logit_rows.shape[0]
        key = (cache.buf.data_ptr(), t, attn_mask.shape[1], r)
        g = self.graphs.get(key) or self._make(key, cache, t, attn_mask.shape[1], r)
        cache.slots(t)                                   # capacity check with the cache's message
        g.ids.copy_(input_ids)
        g.pos.copy_(position_ids)
        g.mask.copy_(attn_mask)
        g.rows.copy_(logit_rows)
        torch.arange(cache.used, cache.used + t, out=g.slot)
        g.run()
        g.replays += 1
        cache.advance(t)
        return g.logits

    def _make(self, key: tuple, cache: KVCache, t: int, total: int, r: int) -> StepGraph:
        dev = cache.buf.device
        g = StepGraph(ids=torch.zeros(t, dtype=torch.int64, device=dev),
                      pos=torch.zeros(t, dtype=torch.int64, device=dev),
                      mask=torch.zeros(t, total, dtype=torch.bool, device=dev),
                      rows=torch.zeros(r, dtype=torch.int64, device=dev),
                      slot=torch.zeros(t, dtype=torch.int64, device=dev),
                      logits=torch.zeros(r, self.spec.vocab_size, dtype=torch.float32, device=dev))
        past = cache.past(total - t)                     # fixed views: fixed addresses for the graph
        layers = [(l, j) for l in range(self.spec.num_layers) for j in (0, 1)]

        def body() -> None:
            logits, new_kv = self.model(g.ids, g.pos, g.mask, g.rows, past)
            for (l, j), x in zip(layers, new_kv):
                cache.buf[l, j].index_copy_(0, g.slot, x)
            g.logits.copy_(logits)

        g.run = body
        if self.fallback_reason is None:
            g.run = self._capture(body, key)
        self.graphs[key] = g
        return g

    def _capture(self, body: Callable[[], None], key: tuple) -> Callable[[], None]:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                # warm-up outside capture, as torch requires
                for _ in range(self.warmup):
                    body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            return graph.replay
        except Exception as e:                           # an op that cannot be captured
            log.warning("CUDA graph capture failed for step shape %s (%s: %s); running eagerly",
                        key[1:], type(e).__name__, e)
            return body
