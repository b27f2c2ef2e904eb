"""A yardstick for the profile: the same shapes written with torch's fused building blocks, timed
the same way. One GEMM for q/k/v and one for gate/up, `F.rms_norm`, the KV of a layer as one
[B, Hkv, C, D] tensor per K and V written in place, and `F.scaled_dot_product_attention` over all
heads at once (grouped-query, no repeated KV). Random weights; not a model trtspec runs, and not
checked for any output: it measures how close to the weight-read floor a step of these shapes
gets with fewer, fused kernels, beside the Decoder's own step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trtspec.export.model import rotate_half
from trtspec.export.spec import ModelSpec
from .timing import is_cuda


class Reference(torch.nn.Module):
    def __init__(self, spec: ModelSpec, device: str, batch: int, capacity: int):
        super().__init__()
        dtype = torch.bfloat16 if is_cuda(device) else torch.float32
        h, kv, d, e = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        self.spec, self.h, self.kv, self.d = spec, h, kv, d

        def w(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.embed = w(spec.vocab_size, e)
        self.layers = [dict(norm1=torch.ones(e, device=device, dtype=dtype), qkv=w((h + 2 * kv) * d, e),
                            o=w(e, h * d), norm2=torch.ones(e, device=device, dtype=dtype),
                            gate_up=w(2 * spec.intermediate_size, e), down=w(e, spec.intermediate_size))
                       for _ in range(spec.num_layers)]
        self.norm = torch.ones(e, device=device, dtype=dtype)
        self.lm_head = w(spec.vocab_size, e)
        self.cache = [(torch.zeros(batch, kv, capacity, d, device=device, dtype=dtype),
                       torch.zeros(batch, kv, capacity, d, device=device, dtype=dtype))
                      for _ in range(spec.num_layers)]
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        self.inv_freq = inv

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, past: int) -> torch.Tensor:
        """One step over ids [B, T] after `past` cached rows (a static length: one graph per shape)."""
        b, t = ids.shape
        pos = past + torch.arange(t, device=ids.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        cos = torch.cat([freqs.cos()] * 2, -1).to(self.embed.dtype)
        sin = torch.cat([freqs.sin()] * 2, -1).to(self.embed.dtype)
        x = F.embedding(ids, self.embed)
        mask = None if t == 1 else torch.ones(t, past + t, dtype=torch.bool, device=ids.device).tril(past)
        h, kv, d, eps = self.h, self.kv, self.d, self.spec.rms_norm_eps
        for layer, (kc, vc) in zip(self.layers, self.cache):
            y = F.rms_norm(x, (x.shape[-1],), layer["norm1"], eps)
            q, k, v = F.linear(y, layer["qkv"]).view(b, t, h + 2 * kv, d).transpose(1, 2).split([h, kv, kv], 1)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            kc[:, :, past:past + t] = k
            vc[:, :, past:past + t] = v
            a = F.scaled_dot_product_attention(q, kc[:, :, :past + t], vc[:, :, :past + t], attn_mask=mask,
                                               enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, h * d), layer["o"])
            y = F.rms_norm(x, (x.shape[-1],), layer["norm2"], eps)
            gate, up = F.linear(y, layer["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(F.rms_norm(x, (x.shape[-1],), self.norm, eps), self.lm_head)

