"""The decoder step's small ops as one Triton kernel each (issue 61, "a decoder step in a few kernels").

Three kernels. Each program takes a fixed number of rows (set by the model's shape, never by the
step's: one row a program at 8B shapes, many in a tiny model) and reduces within a row only, so a
row's result depends on that row's values alone, whatever shares its forward: the exactness of the
logical step (engines/logical_engine.py) is kept by construction.

- `add_rms_norm`: the residual add and the RMSNorm after it in one pass (fp32 statistics as
  export/model.py's RMSNorm, the sum rounded to the model's dtype as torch's own add rounds it).
- `act_mul`: SiLU(gate) (or gelu's tanh form: Gemma's GeGLU) times up over a joined gate/up
  product's output, each rounded as torch rounds them (the activation to the dtype, then the product).
- `rope_write` (all of a row's heads in one program): a joined q/k/v product's output to rotated
  queries, and its keys (rotated) and values written straight into the KV pool's rows (a Qwen3 q/k
  norm before the rotary, partial rotary as the config says); the rotary's products and sum
  rounded one by one as torch's eager `q * cos + rotate_half(q) * sin` rounds them.

Each rounds where export/model.py's torch ops round; only the sum of squares inside a norm is
reduced in another order than torch's (and the exp inside SiLU and tanh is Triton's), so outputs are
close to the eager Decoder's, not its bits (tests/e2e/test_fused_step.py measures both). Triton is
needed only where they run (a GPU, or the CPU's interpreter under TRITON_INTERPRET=1 in the tests),
compiled on first use.
"""
from __future__ import annotations

import torch

_KERNELS: dict | None = None


def _kernels() -> dict:
    """The kernels, compiled on first use (so TRITON_INTERPRET is read when they are made, and triton
    is needed only where they run)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _define()
    return _KERNELS


def _define() -> dict:
    global tl, _round, _scaled       # the kernels find what they call through this module's globals
    import triton
    import triton.language as tl

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """x (fp32) rounded to DTYPE to nearest even, as torch rounds: bf16 by its bits, so that the
        CPU's interpreter (whose own cast truncates) and a GPU give the same values."""
        if DTYPE == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            x = tl.where(x == x, b.to(tl.float32, bitcast=True), x)           # NaN stays NaN
        return x.to(DTYPE)

    @triton.jit
    def _scaled(y, w_ptr, cols, live, OFFSET: tl.constexpr, FP32_SCALE: tl.constexpr, DTYPE: tl.constexpr):
        """export/model.py RMSNorm's last line: y (fp32, normalised) times the weight."""
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        if FP32_SCALE:                   # Gemma: (1 + w) or w, applied in fp32 before the cast
            if OFFSET:
                w = 1.0 + w
            return _round(y * w, DTYPE)
        return _round(w * _round(y, DTYPE).to(tl.float32), DTYPE)

    @triton.jit
    def norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, rows, n, eps, HAS_RES: tl.constexpr,
                    OFFSET: tl.constexpr, FP32_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        live = (row < rows) & (cols < n)
        at = row * n + cols
        x = tl.load(x_ptr + at, mask=live, other=0.0)
        dtype = x.dtype
        if HAS_RES:                      # x + h rounded to the dtype, kept as the new residual stream
            x = _round(x.to(tl.float32) + tl.load(h_ptr + at, mask=live, other=0.0).to(tl.float32), dtype)
            tl.store(sum_ptr + at, x, mask=live)
        x32 = x.to(tl.float32)
        y = x32 * tl.math.rsqrt(tl.sum(x32 * x32, 1) / n + eps)[:, None]
        tl.store(out_ptr + at, _scaled(y, w_ptr, cols, live, OFFSET, FP32_SCALE, dtype), mask=live)

    @triton.jit
    def act_mul_kernel(gu_ptr, out_ptr, rows, inter, TANH_GELU: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK: tl.constexpr):
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
        live = (row < rows) & (cols < inter)
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=live, other=0.0)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=live, other=0.0)
        g32 = g.to(tl.float32)
        if TANH_GELU:                    # Gemma's GeGLU: gelu's tanh form, tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (g32 + 0.044715 * g32 * g32 * g32)
            s = _round(0.5 * g32 * (2.0 / (1.0 + tl.exp(-2.0 * z))), g.dtype)
        else:
            s = _round(g32 / (1.0 + tl.exp(-g32)), g.dtype)
        tl.store(out_ptr + row * inter + cols, _round(s.to(tl.float32) * u.to(tl.float32), g.dtype), mask=live)

    @triton.jit
    def rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, qkn_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, write_ptr, rows,
                          sk_s, sk_h, sk_p, sv_s, sv_h, sv_p, eps,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NP: tl.constexpr,
                          R: tl.constexpr, QK_NORM: tl.constexpr, OFFSET: tl.constexpr, FP32_SCALE: tl.constexpr,
                          ROWS: tl.constexpr):
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None, None]
        hd = tl.arange(0, NP)[None, :, None]                           # a row's heads: q, then k, then v
        d = tl.arange(0, DP)[None, None, :]
        live = (row < rows) & (hd < H + 2 * HKV) & (d < D)
        qk = hd < H + HKV                                              # rotated (and normed): q and k
        half: tl.constexpr = R // 2
        partner = tl.where(d < half, d + half, d - half)              # rotate_half's source column
        turn = (d < R) & qk
        base = qkv_ptr + row * (H + 2 * HKV) * D + hd * D
        x = tl.load(base + d, mask=live, other=0.0)
        dtype = x.dtype
        xp = tl.load(base + partner, mask=live & turn, other=0.0)
        if QK_NORM:                      # Qwen3: each head of q and k normed over D before the rotary
            x32 = x.to(tl.float32)
            r = tl.math.rsqrt(tl.sum(x32 * x32, 2) / D + eps)[:, :, None]
            w = qkn_ptr + (hd >= H).to(tl.int64) * D                   # q's weight, then k's
            x = tl.where(qk, _scaled(x32 * r, w, d, live & qk, OFFSET, FP32_SCALE, dtype), x)
            xp = _scaled(xp.to(tl.float32) * r, w, partner, live & turn, OFFSET, FP32_SCALE, dtype)
        rot = tl.where(d < half, -xp.to(tl.float32), xp.to(tl.float32))
        c = tl.load(cos_ptr + row * R + d, mask=(row < rows) & (d < R), other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * R + d, mask=(row < rows) & (d < R), other=0.0).to(tl.float32)
        a = _round(x.to(tl.float32) * c, dtype).to(tl.float32)
        b = _round(rot * s, dtype).to(tl.float32)
        y = tl.where(turn, _round(a + b, dtype), x)
        tl.store(q_ptr + (row * H + hd) * D + d, y.to(q_ptr.dtype.element_ty), mask=live & (hd < H))
        slot = tl.load(slot_ptr + row, mask=row < rows, other=0)
        at = tl.load(write_ptr + row, mask=row < rows, other=0)
        tl.store(k_ptr + slot * sk_s + (hd - H) * sk_h + at * sk_p + d, y.to(k_ptr.dtype.element_ty),
                 mask=live & qk & (hd >= H))
        tl.store(v_ptr + slot * sv_s + (hd - H - HKV) * sv_h + at * sv_p + d, x.to(v_ptr.dtype.element_ty),
                 mask=live & (hd >= H + HKV))

    return dict(norm=norm_kernel, act_mul=act_mul_kernel, rope_write=rope_write_kernel)


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


TILE = 4096     # values per program: a model's rows per program are TILE // (a row's block), fixed by its shape


def _rows(block: int) -> int:
    """Rows per program for rows of `block` values: a function of the model's shape alone, never of
    the step's, so a row's program is the same code in every step (one row each at 8B shapes)."""
    return max(1, TILE // block)


def _flags(norm) -> dict:
    """export/model.py RMSNorm's form as the kernels' flags."""
    return dict(OFFSET=bool(norm.offset), FP32_SCALE=bool(norm.fp32_scale))


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, norm(x + h)) over the last axis (h None: (x, norm(x))); `norm`: an export/model.py
    RMSNorm, whose weight and form it applies. x and h contiguous, the same shape and dtype."""
    n = x.shape[-1]
    rows, block = x.numel() // n, pow2(n)
    out = torch.empty_like(x)
    total = torch.empty_like(x) if h is not None else x
    per = _rows(block)
    _kernels()["norm"][(-(-rows // per),)](x, h if h is not None else x, norm.weight, total, out, rows, n, norm.eps,
                                           HAS_RES=h is not None, ROWS=per, BLOCK=block, **_flags(norm))
    return total, out


def act_mul(gate_up: torch.Tensor, tanh_gelu: bool = False) -> torch.Tensor:
    """act(gate) * up of a joined [.., 2I] product's output (gate first): [.., I]; act SiLU, or
    gelu's tanh form (Gemma's GeGLU)."""
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * inter)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(inter))
    per = _rows(block)
    _kernels()["act_mul"][(-(-rows // per), -(-inter // block))](gate_up, out, rows, inter, TANH_GELU=tanh_gelu,
                                                                  ROWS=per, BLOCK=block)
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int, int],
               qk_norm, k_pool: torch.Tensor, v_pool: torch.Tensor, slot: torch.Tensor, write: torch.Tensor,
               q_dtype: torch.dtype) -> torch.Tensor:
    """qkv [N, (H + 2 Hkv) D] (a joined product's output, contiguous) to the rotated queries [N, H, D]
    in `q_dtype`; the rotated keys and the values written into k_pool / v_pool [slots, Hkv, S, D] at
    row `write[i]` of slot `slot[i]`. cos, sin [N, R] (Decoder.rotary's; R the rotary dims, R <= D:
    the rest passes as it is); heads (H, Hkv, D); qk_norm None, or (q's and k's norm weights joined
    [2D], an export/model.py RMSNorm whose eps and form they take): each head normed before the rotary."""
    n = qkv.shape[0]
    h, kv, d = heads
    q = torch.empty(n, h, d, dtype=q_dtype, device=qkv.device)
    weight, norm = qk_norm if qk_norm is not None else (cos, None)
    flags = _flags(norm) if norm is not None else dict(OFFSET=False, FP32_SCALE=False)
    np_, dp = pow2(h + 2 * kv), pow2(d)
    per = _rows(np_ * dp)
    _kernels()["rope_write"][(-(-n // per),)](
        qkv, cos, sin, weight, q, k_pool, v_pool, slot, write, n,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        norm.eps if norm is not None else 0.0, H=h, HKV=kv, D=d, DP=dp, NP=np_, R=cos.shape[-1],
        QK_NORM=norm is not None, ROWS=per, **flags)
    return q
