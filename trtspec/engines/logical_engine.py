"""LogicalTorchEngine: a torch target exact in its own dtype, reading the KV pool in place (issue 61).

Attention runs engines/logical_attention.py's kernel: each row reduces over its keys in logical
order (committed prefix, then its ancestors by depth, then itself), so a tree row is the same
arithmetic as the same token decoded alone, in the model's dtype (bf16 KV, fp32 accumulation), not
fp64 (`exactness: logical`; engines/exact.py's `fixed-fp64` is the fallback setting). The products
stay row-local as in `fixed-fp64`: every step at the one token bucket, cuBLAS without split-K.

In place: the step's new K/V rows are written straight into the pool's scratch rows (at the slot's
`used` + i) and attention reads the pool by slot; nothing is staged or copied back. A row's keys
come from the Batcher's mask: the committed prefix, then its visible rows after it in ascending
order (scratch rows in the order they were fed, the step's rows in the tree's topological order:
both are depth order along a path), as pool rows. With `cuda_graphs` one graph per (B, T, C, R)
shape replays over static inputs (tokens, positions, logit rows, slot ids, prefixes, tails, write
rows) and the pool itself, which never moves; a shape is captured at its first step, on that step's
inputs (so warm-up and capture write only that step's own rows: never a live row of another slot);
without a CUDA device the same body runs eagerly on the same buffers (how it is tested on the CPU,
under TRITON_INTERPRET=1). The step itself is engines/fused_step.py's: the Decoder's weights and
arithmetic in ten kernels a layer (joined q/k/v and gate/up products, fused norm, rotary + KV write,
SiLU * up).
"""
from __future__ import annotations

import importlib.util

import torch

from ..errors import ConfigError
from ..export.model import Decoder
from ..runtime.kv_cache import KVCache
from .cuda_graphs import capture
from .exact import matmul_flags
from .fused_blocks import pow2
from .fused_step import fused_step, join
from .torch_engine import TorchEngine


class LogicalTorchEngine(TorchEngine):
    name = "torch-logical"
    exact = True
    fixed_rows = True                     # the Batcher pads a one-row call's logit rows to the bucket
    logits_in_own_buffer = True

    def __init__(self, model: Decoder, device: str = "cpu", cuda_graphs: bool = False):
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("exactness: logical runs a Triton kernel and triton is not installed; "
                              "pip install triton (it comes with torch's CUDA builds), or set exactness: fixed-fp64")
        super().__init__(model, device)
        self.joined = join(self.model)            # q/k/v and gate/up as one product each (fused_step.py)
        self.cuda_graphs = cuda_graphs and str(device).startswith("cuda") and torch.cuda.is_available()
        self.shapes: dict[tuple, "_Shape"] = {}

    @torch.inference_mode()
    def step_batch(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> torch.Tensor:
        (b, t), r = input_ids.shape, logit_rows.shape[1]
        self.check_room(caches, t)
        pool = caches[0].pool
        assert all(c.pool is pool for c in caches), "one step reads one pool"
        tail = pow2(max(c.scratch for c in caches) + t)
        key = (b, t, attn_mask.shape[2], r, tail, pool.data_ptr())
        with matmul_flags(self.exact):
            s = self.shapes.get(key) or self._make(key, pool)
            s.load(caches, input_ids, position_ids, attn_mask, logit_rows)
            if s.run is None:       # captured on this step's own inputs: its warm-up writes this step's rows only
                s.run = capture(s.body) if self.cuda_graphs else s.body
            s.run()
        self.hidden = s.hidden
        return s.logits

    def _make(self, key: tuple, pool: torch.Tensor) -> "_Shape":
        b, t, width, r, tail, _ = key
        s = _Shape(self.spec, self.device, b, t, width, r, tail, self.hidden_rows)

        def body() -> None:
            logits, hidden = fused_step(self.model, self.joined, s.ids, s.pos, s.rows, pool, s.slot, s.write,
                                        s.prefix, s.tail, s.ntail)
            s.logits.copy_(logits)
            if hidden is not None:
                s.hidden.copy_(hidden)

        s.body, s.run = body, None
        self.shapes[key] = s
        return s


class _Shape:
    """One step shape's static inputs, each row's keys (slot, prefix, tail) and its outputs."""

    def __init__(self, spec, device, b: int, t: int, width: int, r: int, tail: int, hidden: bool):
        i64, i32 = torch.int64, torch.int32
        self.b, self.t, self.width = b, t, width
        self.ids = torch.zeros(b, t, dtype=i64, device=device)
        self.pos = torch.zeros(b, t, dtype=i64, device=device)
        self.mask = torch.zeros(b, t, width, dtype=torch.bool, device=device)
        self.rows = torch.zeros(b, r, dtype=i64, device=device)
        self.slot = torch.zeros(b * t, dtype=i64, device=device)         # each row's KV slot
        self.write = torch.zeros(b * t, dtype=i64, device=device)        # the pool row its new K/V go to
        self.prefix = torch.zeros(b * t, dtype=i32, device=device)
        self.tail = torch.full((b * t, tail), -1, dtype=i32, device=device)
        self.ntail = torch.zeros(b * t, dtype=i32, device=device)
        self.logits = torch.zeros(b, r, spec.vocab_size, dtype=torch.float32, device=device)
        self.hidden = torch.zeros(b, r, spec.hidden_size, dtype=torch.float32, device=device) if hidden else None
        self._iota = torch.arange(t, device=device)
        self._cols = torch.arange(width, device=device)
        self._meta = torch.zeros(3, b, dtype=i64, device=device)           # each call's length, used, slot
        self._out = torch.empty(b, t, tail + 1, dtype=i64, device=device)  # the tails, scattered (+ a dump column)

    def load(self, caches: list[KVCache], ids, pos, mask, rows) -> None:
        """This step's inputs into the static buffers, and each row's keys from the mask: the slot's
        committed prefix (none for a pad row), then the visible rows after it in ascending order (mask
        columns before `width - t` are pool rows as they lie, the rest the step's new rows at
        `used` + i)."""
        b, t, past = self.b, self.t, self.width - self.t
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.mask.copy_(mask)
        self.rows.copy_(rows)
        host = torch.tensor([[c.length for c in caches], [c.used for c in caches], [c.slot for c in caches]])
        length, used, slot = self._meta.copy_(host)                           # one host-to-device copy
        self.slot.copy_(slot.repeat_interleave(t))
        self.write.copy_((used[:, None] + self._iota).flatten())
        cols = self._cols
        # a row sees its slot's committed prefix unless it is a pad row (it sees itself only): those
        # read one key, not the whole prefix
        sees = self.mask.gather(-1, (length - 1).clamp(min=0)[:, None, None].expand(b, t, 1))[..., 0]
        self.prefix.copy_(torch.where(sees & (length > 0)[:, None], length[:, None], 0).flatten())
        phys = torch.where(cols < past, cols, used[:, None] + cols - past)           # [B, W] pool rows
        after = self.mask & (cols >= self.prefix.view(b, t, 1))                       # [B, T, W]
        rank = after.cumsum(-1) - 1
        n = self.tail.shape[1]
        out = self._out.fill_(-1)
        out.scatter_(-1, torch.where(after, rank, n), phys[:, None, :].expand(b, t, -1))
        self.tail.copy_(out[..., :n].reshape(b * t, n))
        self.ntail.copy_(after.sum(-1).flatten())
