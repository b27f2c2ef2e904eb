"""Prefix caching: prompt KV rows that outlive their request, reused by later requests that share the
prefix (a system prompt, earlier chat turns, a few-shot block).

One `PrefixStore` per model (target, draft), allocated once beside the KV pool: `buf[L, 2, Hkv,
blocks * BLOCK, D]`. A prompt is cut into blocks of BLOCK tokens; a block is known by a digest of
every token up to its end (a chain: a block matches only after the same whole prefix), so a hit
is exact by construction, not by a hash's luck. After a request's prefill its full prompt blocks
that are not stored yet are copied in (`keep`); a new request looks up its prompt's longest stored
chain of blocks, copies those rows into its own slot and commits them (`reuse`: KVCache.load),
then prefills only the rest. Eviction is by recency: a full store gives up its least recently used
block (a chain's later blocks are touched after its earlier ones, so leaves go before their
parents).

Copy on hit, not shared pages: a request's slot is one contiguous block per head (the step contract
binds it in place), so stored rows are copied into it (a memory copy, against a model forward per
prefill chunk; measured in docs/benchmarks.md). No request ever reads the store
while it decodes, so a block needs no reference count: the store changes only in the scheduler
thread, between model calls.

Exactness by construction: a prefill cuts the prompt into chunks that end at multiples of BLOCK in
the sequence (ModelRunner.prefill), so a stored block's rows came from the very call a cold prefill
of this prompt makes, and the rows after a restored prefix are computed by the same calls as cold
(same tokens, positions and past, bit for bit). Tests compare warm and cold rows bit for bit (torch
and ONNX Runtime) and outputs, greedy and sampled, for every strategy.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from ..options import PREFILL_CHUNK
from .kv_cache import KVCache, KVPool, zeros

BLOCK = PREFILL_CHUNK    # tokens per stored block: a prefill chunk, so stored rows are computed as a cold prefill's


class PrefixStore:
    def __init__(self, pool: KVPool, tokens: int, block: int = BLOCK):
        s = pool.spec
        self.block = block
        blocks = tokens // block
        self.buf = zeros((s.num_layers, 2, s.num_kv_heads, blocks * block, s.head_dim), pool.buf.dtype,
                         pool.buf.device)                              # resident as blocks are stored
        self.where: OrderedDict[bytes, int] = OrderedDict()     # chain digest -> block, least recent first
        self.free = list(range(blocks))[::-1]
        self.queried = self.hit = self.stored = self.evicted = 0    # tokens looked up / found, blocks in / out

    def _keys(self, tokens: list[int]) -> list[bytes]:
        """A digest per full block: of every token up to the block's end."""
        h, keys = hashlib.blake2b(digest_size=16), []
        arr = np.asarray(tokens, dtype=np.int64)
        for j in range(len(tokens) // self.block):
            h.update(arr[j * self.block:(j + 1) * self.block].tobytes())
            keys.append(h.copy().digest())
        return keys

    def _rows(self, b: int) -> torch.Tensor:
        return self.buf[:, :, :, b * self.block:(b + 1) * self.block]

    def reuse(self, tokens: list[int], cache: KVCache) -> int:
        """Load the stored rows of `tokens`' longest stored prefix of blocks into the empty `cache`
        (committed); returns how many tokens they cover."""
        found: list[tuple[bytes, int]] = []
        for key in self._keys(tokens):
            b = self.where.get(key)
            if b is None:
                break
            found.append((key, b))
        for key, _ in reversed(found):           # parents most recent: evicted after their children
            self.where.move_to_end(key)
        if found:
            cache.load([self._rows(b) for _, b in found])
        self.queried += len(tokens)
        self.hit += len(found) * self.block
        return len(found) * self.block

    def keep(self, tokens: list[int], cache: KVCache) -> None:
        """Store each full block of `tokens` (rows [0, len(tokens)) of `cache`, committed) not stored yet."""
        keys = self._keys(tokens[:cache.length])
        for j, key in enumerate(keys):
            if key in self.where:
                continue
            b = self._take(set(keys[:j]))
            if b is None:
                break
            self._rows(b).copy_(cache.buf[:, :, :, j * self.block:(j + 1) * self.block])
            self.where[key] = b
            self.stored += 1
        for key in reversed(keys):
            if key in self.where:
                self.where.move_to_end(key)

    def _take(self, keep: set[bytes]) -> int | None:
        """A free block, else the least recently used one (never one of the chain being stored)."""
        if self.free:
            return self.free.pop()
        for key in self.where:
            if key not in keep:
                self.evicted += 1
                return self.where.pop(key)
        return None

    def clear(self) -> None:
        """Forget every stored block (benchmarks' cold runs)."""
        self.where.clear()
        self.free = list(range(self.buf.shape[3] // self.block))[::-1]

    def stats(self) -> dict:
        return {"queried_tokens": self.queried, "hit_tokens": self.hit, "stored_blocks": self.stored,
                "evicted_blocks": self.evicted, "blocks": len(self.where), "capacity_blocks": self.buf.shape[3] // self.block}
