"""Tree attention exact in the model's dtype by logical order (Triton; issue 61).

A row's attention result changes only when its reduction changes: where chunk or split boundaries
fall among its keys, where masked zeros sit inside a chunk, or the order partial results combine.
A tree node's ancestors sit at other KV rows than the same tokens do in sequential decoding, so a
kernel that walks the rows as they lie (masking the others) reduces a tree row differently from the
same token decoded alone. This kernel walks each row's visible keys in *logical* order instead:

    the committed prefix 0 .. c-1 (rows as they lie), then the row's tail (its ancestors within the
    step in depth order, then itself: explicit row indices)

in chunks of CHUNK logical positions (products in fp32, IEEE: a bf16 key times a bf16 query is
exact in fp32, and TF32 would round it), SPLIT positions per program (fixed logical boundaries 0,
SPLIT, 2*SPLIT, ...: a split never depends on the row's length), the splits' partial results
combined in split order by a second kernel. Positions past the row's length are masked after its
keys, in the same places a token decoded alone has them; splits past it exit at once and take no
part. So a tree node's output is the same arithmetic, operation for operation, as the same token's
one-token step: bit for bit, in bf16 KV with fp32 accumulation, whatever shares its forward (each
program reads one row's keys only; the G query heads of a KV head are its rows).

KV is read where it lies: `k`, `v` are one layer's [slots, Hkv, S, D] views of the pool
(runtime/kv_cache.py KVPool.buf[l, 0] and [l, 1]), indexed by each row's slot. The grid is fixed by
the rows, the KV heads and the capacity's splits, so one CUDA graph serves every cached length.

Tested on the CPU under TRITON_INTERPRET=1 (tests/e2e/test_logical_attention.py): the
interpreter checks the order of the arithmetic; a GPU run confirms it on the hardware
(lab/device_check). `order="physical"` is the kernel people write (the step's rows as they lie, the
others masked in place), kept so the tests can show that it differs.
"""
from __future__ import annotations

import math

import torch

CHUNK = 64           # logical positions per inner block
SPLIT = 256          # logical positions per program (a multiple of CHUNK): fixed split boundaries


def _kernels():
    """The Triton kernels, compiled on first use (triton is needed only where they run)."""
    global _SPLIT_KERNEL, _COMBINE_KERNEL
    if _SPLIT_KERNEL is not None:
        return _SPLIT_KERNEL, _COMBINE_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, prefix_ptr, tail_ptr, ntail_ptr,
                     m_ptr, l_ptr, acc_ptr,
                     sq_r, sq_h, sk_s, sk_h, sk_p, sv_s, sv_h, sv_p, st_r,
                     scale, window, NSPLIT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                     CHUNK: tl.constexpr, SPLIT: tl.constexpr, MAXTAIL: tl.constexpr,
                     LOGICAL: tl.constexpr):
        row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        c = tl.load(prefix_ptr + row)
        nt = tl.load(ntail_ptr + row)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if LOGICAL:
            total = c + nt
        else:                          # physical: every row up to the step's last, masked in place
            total = c + MAXTAIL
        lo = split * SPLIT
        first = tl.maximum(total - tl.where(window > 0, window, total), 0)   # a sliding window: its last keys
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        out = (row * (NSPLIT * tl.num_programs(1)) + split * tl.num_programs(1) + kvh) * GP + g
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        q = tl.load(q_ptr + row * sq_r + (kvh * G + g)[:, None] * sq_h + d[None, :],
                    mask=(g < G)[:, None], other=0.0).to(tl.float32)
        kbase = k_ptr + slot * sk_s + kvh * sk_h
        vbase = v_ptr + slot * sv_s + kvh * sv_h
        hi = tl.minimum(lo + SPLIT, total)
        for start in range(tl.maximum(lo, first // CHUNK * CHUNK), hi, CHUNK):     # chunks before `first`: none
            pos = start + tl.arange(0, CHUNK)
            if LOGICAL:
                live = (pos < total) & (pos >= first)
                t = tl.load(tail_ptr + row * st_r + (pos - c), mask=live & (pos >= c), other=0)
                phys = tl.where(pos < c, pos, t).to(tl.int64)
            else:
                tail = tl.load(tail_ptr + row * st_r + tl.arange(0, MAXTAIL))
                seen = tl.sum(((pos[:, None] - c) == tail[None, :]).to(tl.int32), 1) > 0
                live = (pos < c) | ((pos < total) & seen)
                phys = pos.to(tl.int64)
            kt = tl.load(kbase + phys[None, :] * sk_p + d[:, None], mask=live[None, :], other=0.0)
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee") * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with no live key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(vbase + phys[:, None] * sv_p + d[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            m_i = m_new
        tl.store(m_ptr + out, m_i)
        tl.store(l_ptr + out, l_i)
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc)

    @triton.jit
    def combine_kernel(m_ptr, l_ptr, acc_ptr, prefix_ptr, ntail_ptr, o_ptr, so_r, so_h,
                       NSPLIT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       SPLIT: tl.constexpr, MAXTAIL: tl.constexpr, LOGICAL: tl.constexpr):
        row, kvh = tl.program_id(0), tl.program_id(1)
        if LOGICAL:
            total = tl.load(prefix_ptr + row) + tl.load(ntail_ptr + row)
        else:
            total = tl.load(prefix_ptr + row) + MAXTAIL
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for split in range(0, tl.cdiv(total, SPLIT)):            # in split order; empty splits never run
            at = (row * (NSPLIT * tl.num_programs(1)) + split * tl.num_programs(1) + kvh) * GP + g
            m_j = tl.load(m_ptr + at)
            m_new = tl.maximum(m, m_j)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a, b = tl.exp(m - m_safe), tl.exp(m_j - m_safe)
            l = l * a + tl.load(l_ptr + at) * b
            acc = acc * a[:, None] + tl.load(acc_ptr + at[:, None] * D + d[None, :]) * b[:, None]
            m = m_new
        res = acc / tl.where(l == 0.0, 1.0, l)[:, None]          # a padding row (no key): zeros
        tl.store(o_ptr + row * so_r + (kvh * G + g)[:, None] * so_h + d[None, :],
                 res.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])

    _SPLIT_KERNEL, _COMBINE_KERNEL = split_kernel, combine_kernel
    return split_kernel, combine_kernel


_SPLIT_KERNEL = _COMBINE_KERNEL = None


def logical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor,
                      prefix: torch.Tensor, tail: torch.Tensor, ntail: torch.Tensor,
                      chunk: int = CHUNK, split: int = SPLIT, order: str = "logical",
                      out: torch.Tensor | None = None, scale: float | None = None, window: int = 0) -> torch.Tensor:
    """Attention of R rows over their slots' KV, in logical order.

    q [R, H, D] (the rows' queries after rotary, the model's dtype); k, v [slots, Hkv, S, D] (one
    layer of the pool, rows as they lie, the step's new rows already written); slot [R] (each row's
    KV slot), prefix [R] (its committed length c: rows 0..c-1 are its first keys), tail [R, MAXTAIL]
    (the rows of its keys after the prefix in logical order: ancestors by depth, then itself; row
    indices into the slot, -1 past ntail), ntail [R]. A row with no key (a padding row) gives zeros.
    Returns [R, H, D] in q's dtype. `scale`: the scores' (default D^-1/2); `window` > 0: each row sees
    its last `window` keys in logical order (itself included: a sliding-window layer, as
    export/model.py's window_mask counts them), the same positions the same token sees decoded alone.
    `order="physical"`: rows c .. c+MAXTAIL-1 as they lie, those not in the row's tail masked in place
    (for tests: the order people write, which is not exact)."""
    assert order in ("logical", "physical") and split % chunk == 0 and (window == 0 or order == "logical")
    split_kernel, combine_kernel = _kernels()
    r, h, d = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    g = h // hkv
    gp = max(16, 1 << (g - 1).bit_length())            # tl.dot's smallest block
    nsplit = math.ceil((cap + 1) / split)
    maxtail = tail.shape[1]
    assert maxtail & (maxtail - 1) == 0, "tail columns: a power of two"
    m = torch.empty(r * nsplit * hkv * gp, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(r * nsplit * hkv * gp, d, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    tail = torch.where(tail < 0, -1, tail - prefix[:, None]) if order == "physical" else tail
    logical = order == "logical"
    split_kernel[(r, hkv, nsplit)](q, k, v, slot, prefix, tail, ntail, m, lsum, acc,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                                   v.stride(0), v.stride(1), v.stride(2), tail.stride(0),
                                   1.0 / math.sqrt(d) if scale is None else scale, window, NSPLIT=nsplit, G=g,
                                   GP=gp, D=d, CHUNK=chunk, SPLIT=split, MAXTAIL=maxtail, LOGICAL=logical)
    combine_kernel[(r, hkv)](m, lsum, acc, prefix, ntail, out, out.stride(0), out.stride(1),
                             NSPLIT=nsplit, G=g, GP=gp, D=d, SPLIT=split, MAXTAIL=maxtail, LOGICAL=logical)
    return out
