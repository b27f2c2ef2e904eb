"""TorchEngine: the step contract run eagerly by the torch Decoder (CPU or CUDA)."""
from __future__ import annotations

import torch

from ..export.model import Decoder
from ..runtime.kv_cache import KVCache
from .base import Engine


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, model: Decoder, device: str = "cpu"):
        self.model = model.to(device)
        self.spec = model.spec
        self.kv_dtype = model.model.embed_tokens.weight.dtype   # int8 drafts keep float embeddings
        self.device = device

    @torch.inference_mode()
    def step(self, cache: KVCache, input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        t = input_ids.shape[0]
        slots = cache.slots(t)
        past = cache.past(attn_mask.shape[1] - t)   # = used, or a padded cache-length bucket
        logits, new_kv = self.model(input_ids, position_ids, attn_mask, logit_rows, past)
        for dst, src in zip(slots, new_kv):
            dst.copy_(src)
        cache.advance(t)
        return logits
