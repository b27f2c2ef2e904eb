"""TorchEngine: the step contract run eagerly by the torch Decoder (CPU or CUDA)."""
from __future__ import annotations

import torch

from ..export.model import Decoder
from ..runtime.engine import Engine
from ..runtime.kv_cache import BatchStaging, KVCache
from .exact import matmul_flags


class TorchEngine(Engine):
    name = "torch"
    exact = False                         # engines/exact.py: every step under its cuBLAS flags

    def __init__(self, model: Decoder, device: str = "cpu"):
        self.model = model.to(device)
        self.spec = model.spec
        self.kv_dtype = model.kv_dtype     # the weights' (int8 drafts keep float embeddings), or exact attention's
        self.device = device
        self.staging = BatchStaging(self.spec, self.kv_dtype, device)
        self.hidden_rows = model.hidden_rows          # the model also returns the rows its LM head read

    @torch.inference_mode()
    def step_batch(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        b, t = input_ids.shape
        c = attn_mask.shape[2] - t            # = used, or a padded length (cache bucket, batch)
        self.check_room(caches, t)
        if b == 1:                            # read the past where it lies
            past = [p.unsqueeze(0) for p in caches[0].past(c)]
        else:
            past = list(self.staging.past(caches, c))
        with matmul_flags(self.exact):
            logits, new_kv, *hidden = self.model(input_ids, position_ids, attn_mask, logit_rows, past)
        self.hidden = hidden[0] if hidden else None
        for i, cache in enumerate(caches):
            for dst, src in zip(cache.slots(t), new_kv):
                dst.copy_(src[i])
        return logits
