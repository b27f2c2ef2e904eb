"""A lean decoder (every family in export/families/) whose single forward is the trtspec step contract (v3).

    forward(input_ids[B, T], position_ids[B, T], attn_mask[B, T, C+T], logit_rows[B, R],
            past[2L*Hkv x (B, C, D)]) -> logits[B, R, V] (float32), new_kv[2L*Hkv x (B, T, D)]
                                         (, hidden[B, R, hidden] (float32) with `hidden_rows`)

(KV lists ordered layer, key/value, KV head: one tensor per head, contract v3.)

The same call is a prefill chunk (causal mask), a one-token decode (T=1), a draft expansion of a
frontier, or the verification of a whole token tree, for B requests at once: the caller encodes
each row's structure in its mask and depth-based position ids (rows never see each other; padding
is masked). Only `logit_rows` reach the LM head, because a 150k-token vocabulary makes logits for
every row the largest tensor of the step. The module names follow Hugging Face so
HF state dicts load unchanged. Written with plain matmul/softmax so ONNX export uses standard ops.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .rotary_op import rotary
from .spec import ModelSpec, SpecError


def rope_inv_freq(spec: ModelSpec, local: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies, with the config's rope scaling folded in (as transformers does);
    `local`: the windowed layers' own unscaled rotary (Gemma 3's local base)."""
    if local:
        spec = dataclasses.replace(spec, rope_theta=spec.local_rope_theta, rope_scaling=None)
    d = spec.rope_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = spec.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "yarn":
        inv = _yarn(spec, rs, d)
    elif kind == "longrope":            # in float32, as transformers computes it
        factors = torch.tensor(rs["long_factor" if rs.get("factors") == "long" else "short_factor"], dtype=torch.float32)
        inv = 1.0 / (factors * spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "dynamic":
        raise SpecError("rope scaling type 'dynamic' is not supported: its frequencies follow the longest position "
                        "of each forward, so a token's rotation would depend on what it is computed with and "
                        "speculation could not be lossless; use the model's yarn or linear scaling, or none")
    else:
        raise SpecError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn, "
                        "longrope)")
    return inv.float()


def rope_attention_factor(spec: ModelSpec) -> float:
    """What cos and sin are multiplied by (yarn's attention factor; 1 otherwise), as transformers does."""
    rs = spec.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if kind == "longrope":
        old = rs.get("original_max_position_embeddings") or spec.max_position_embeddings
        factor = rs.get("factor") or spec.max_position_embeddings / old
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    factor, _ = _yarn_context(spec, rs)
    mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    return _yarn_mscale(factor)


def choose_rope_factors(spec: ModelSpec, context: int) -> None:
    """longrope's factors for an engine of `context` positions, as llama.cpp chooses them by its
    context: the long ones past the original context, else the short ones (transformers switches by
    the longest position of each forward, so a token's rotation would depend on what shares its
    forward; here it is fixed per engine, and every strategy equals its `ar`)."""
    rs = spec.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "longrope":
        old = rs.get("original_max_position_embeddings") or spec.max_position_embeddings
        spec.rope_scaling = {**rs, "factors": "long" if context > old else "short"}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_context(spec: ModelSpec, rs: dict) -> tuple[float, int]:
    """(factor, the original context): the factor from the positions when the config gives none."""
    old = rs.get("original_max_position_embeddings") or spec.max_position_embeddings
    return (float(rs["factor"]) if rs.get("factor") is not None else spec.max_position_embeddings / old), old


def _yarn(spec: ModelSpec, rs: dict, d: int) -> torch.Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, in float32 as it computes them):
    interpolated below the ramp, extrapolated above it."""
    base, (factor, old) = spec.rope_theta, _yarn_context(spec, rs)
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations):
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    extra = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra


LOGICAL_CHUNK = 64          # keys per chunk of attention by logical order (Attention.logical)


def logical_keys(attn_mask: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's visible keys in logical order, as (idx [B, T, L] columns of the step's keys, valid
    [B, T, L]): the mask's visible columns in ascending order, which every layout the runtime writes
    makes the row's path in depth order (see window_mask), packed to the front and padded to L, the
    mask's width rounded up to whole chunks of `chunk` keys. The k-th key a row reduces over is then
    the k-th key of its path, wherever its rows lie: a tree node and the same token decoded alone
    read the same keys at the same places (`Attention.chunk`)."""
    b, t, w = attn_mask.shape
    width = (w + chunk - 1) // chunk * chunk
    rank = attn_mask.to(torch.int64).cumsum(-1) - 1
    slot = torch.where(attn_mask, rank, width)                 # a hidden column goes to a dump slot
    cols = torch.arange(w, device=attn_mask.device).expand(b, t, w)
    idx = torch.zeros(b, t, width + 1, dtype=torch.int64, device=attn_mask.device).scatter(-1, slot, cols)
    valid = torch.arange(width, device=attn_mask.device) < attn_mask.sum(-1, keepdim=True)
    return idx[..., :width], valid


def in_place_chunks(idx: torch.Tensor, valid: torch.Tensor, chunk: int, past: int) -> int:
    """How many leading whole chunks of logical_keys' lists every row reads from the past as it lies
    (its k-th key is past column k: the committed prefix, written in order), so that Attention.logical
    reads them in place, once for all rows. Data-dependent: once per step and mask, not per layer."""
    col = torch.arange(idx.shape[-1], device=idx.device)
    lead = torch.where((idx == col) & valid, idx.shape[-1], col).amin(-1)   # each row's first key elsewhere
    chunks = (lead.min().clamp(max=past) // chunk).item()
    torch._check_is_size(chunks)
    torch._check(chunks * chunk <= past)
    torch._check(chunks * chunk <= idx.shape[-1])
    return chunks


def window_mask(attn_mask: torch.Tensor, window: int) -> torch.Tensor:
    """`attn_mask` [B, T, C+T] narrowed to each row's last `window` visible keys. A row's visible keys
    are its whole history in logical order (the committed prefix, then its ancestors as they were fed,
    then itself: every layout the runtime writes keeps a path's rows in depth order), so its last
    `window` are the keys the same token sees in sequential decoding (transformers' sliding window:
    key position > query position - window), wherever the rows lie: a tree node at depth d, a draft
    row over its scratch ancestors. Counted, not computed from positions, so it is exact by
    construction for any tree."""
    seen = attn_mask.to(torch.int32).cumsum(-1)              # visible keys up to and including each
    return attn_mask & (seen > seen[..., -1:] - window)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False, fp32_scale: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset, self.fp32_scale = eps, offset, fp32_scale or offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as the reference implementations do, so bf16 weights stay accurate.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_scale:              # Gemma: (1 + w), applied in fp32 before the cast
            return (x32 * ((1.0 + self.weight.float()) if self.offset else self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def norm(spec: ModelSpec, dim: int) -> RMSNorm:
    """The family's RMSNorm over `dim`: Gemma's scales by (1 + w) in fp32, or by w where the weights
    already hold 1 + w (llama.cpp's Gemma GGUFs: `norm_weights_shifted`)."""
    gemma = spec.family.norm_offset
    return RMSNorm(dim, spec.rms_norm_eps, offset=gemma and not spec.norm_weights_shifted, fp32_scale=gemma)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    # Attention arithmetic and KV dtype; None: the weights'. float64 (Decoder.exact_attention) makes a
    # row's attention output, rounded to fp32, independent of how many rows a forward carries and
    # where its ancestors sit (docs/design.md, "Exact attention").
    acc: torch.dtype | None = None
    # Logical order (Decoder.logical_attention): each row reduces over its own keys gathered in
    # logical order, in chunks of `chunk` keys, combined in a fixed order; in the weights' dtype.
    chunk = 0
    # Rotary as one ONNX Runtime node per tensor (Decoder.fused_rotary, export/rotary_op.py)
    fused_rope = False

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.h, self.kv, self.d = h, kv, d
        # Gemma scales by query_pre_attn_scalar's -1/2 power, as transformers writes it; the others by
        # 1 / sqrt(head_dim) (the same expression as before, so their graphs are unchanged)
        self.scale = spec.query_pre_attn_scalar ** -0.5 if spec.query_pre_attn_scalar else 1.0 / math.sqrt(d)
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)
        if spec.family.qk_norm:                    # Qwen3: each head of q and of k normed before rotary
            self.q_norm, self.k_norm = norm(spec, d), norm(spec, d)

    def project(self, x, rope):
        """q [B, T, H, D], k and v [B, T, Hkv, D] of the rows `x`, rotary applied to q and k; `rope`:
        Decoder.rotary's (cos, sin), or with fused_rope (cos, sin, rows) as rotary_op takes them."""
        b, t = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(b, t, self.h, self.d)
        k = self.k_proj(x).view(b, t, self.kv, self.d)
        v = self.v_proj(x).view(b, t, self.kv, self.d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_rope:
            cos, sin, rows = rope
            r = 2 * cos.shape[-1]
            q = rotary(q.reshape(b, t, self.h * self.d), cos, sin, rows, self.h, r).view(b, t, self.h, self.d)
            k = rotary(k.reshape(b, t, self.kv * self.d), cos, sin, rows, self.kv, r).view(b, t, self.kv, self.d)
            return q, k, v
        cos, sin = rope
        r = cos.shape[-1]
        if r < self.d:                             # partial rotary (Phi-4-mini): the rest passes as it is
            return (torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], -1),
                    torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], -1), v)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x, rope, mask_add, past_k, past_v):
        # past_k / past_v: one [B, C, D] tensor per KV head (contract v3: head-major, read in place)
        b, t, c = x.shape[0], x.shape[1], past_k[0].shape[1]
        q, k, v = self.project(x, rope)
        if self.chunk:                        # mask_add is (idx, valid, chunks): logical_keys, in_place_chunks
            out = self.logical(q, k, v, *mask_add, past_k, past_v)
            return self.o_proj(out), k.unbind(2), v.unbind(2)
        out_dtype = x.dtype
        if self.acc is not None:              # exact upcasts: the rows' values are the fp32 ones
            q, k, v = q.to(self.acc), k.to(self.acc), v.to(self.acc)
        # Grouped-query attention: the G query heads of a KV head are rows of one [G*T, D] block, so
        # repeated KV heads are never materialised.
        g = self.h // self.kv
        qg = q.view(b, t, self.kv, g, self.d).permute(0, 2, 3, 1, 4).reshape(b, self.kv, g * t, self.d)
        # The past is read where it lies and as it lies, one [B, C, D] block per KV head: q @ past^T
        # is a product with a transposed operand (ONNX Runtime fuses the Transpose into FusedMatMul's
        # transB; no copy of the past), against the new rows and the past apart, joined
        # ([.., G*T, C+T]), one softmax over both, and the two halves of the probabilities weight
        # their own values ([G*T, C] x [C, D], the past as it lies).
        past_scores = torch.stack([torch.matmul(qg[:, i], pk.transpose(1, 2))   # [B, G*T, C] each
                                   for i, pk in enumerate(past_k)], 1)
        scores = torch.cat([past_scores, torch.matmul(qg, k.permute(0, 2, 3, 1))], -1)  # [.., C+T]
        scores = scores.to(self.acc or torch.float32).view(b, self.kv, g, t, c + t)
        scores = scores * self.scale + mask_add
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, self.kv, g * t, c + t)
        past_out = torch.stack([torch.matmul(probs[:, i, :, :c], pv) for i, pv in enumerate(past_v)], 1)
        out = past_out + torch.matmul(probs[..., c:], v.permute(0, 2, 1, 3))   # [B, Hkv, G*T, D]
        out = out.view(b, self.kv, g, t, self.d).permute(0, 3, 1, 2, 4).reshape(b, t, self.h * self.d)
        return self.o_proj(out.to(out_dtype)), k.unbind(2), v.unbind(2)

    def logical(self, q, k, v, idx, valid, chunks, past_k, past_v):
        """Attention by logical order: each row's keys as logical_keys lists them, in chunks of K keys
        (one product of the row's G query heads per chunk, never one matrix of many rows), each
        chunk's max, exp-sum and product with V, then the chunks combined in order (_combine). The
        leading whole chunks every row reads from the past as it lies (`chunks` of them:
        in_place_chunks; the committed prefix) are read there, shared by all rows; only the rest is
        gathered per row (for a tree: under one chunk of the past, then its path). A chunk's
        arithmetic depends on its keys only, in place or gathered, and an empty chunk adds exact zeros,
        so a row's output is the same bits whatever the step's width, its row count and where its
        ancestors lie (measured: lab/exact_attention_cpu.py; tests/e2e/test_engines_cli.py)."""
        b, t, g, c, n = q.shape[0], q.shape[1], self.h // self.kv, past_k[0].shape[1], self.chunk
        p, m = chunks * n, idx.shape[-1] // n - chunks                      # keys in place; chunks gathered
        # the rest of each row's keys: columns past p (its first p keys are columns 0..p-1), gathered
        # from the past after p and the new rows; padding slots (not valid) read row 0
        r = c - p + t
        flat = ((idx[..., p:] - p).clamp(min=0) + (torch.arange(b, device=idx.device) * r).view(b, 1, 1)).reshape(-1)
        seen = valid[..., p:].view(b, t, m, 1, n)
        qs = q.view(b, t, self.kv, g, self.d)
        out = []
        for i in range(self.kv):                                                # each KV head as it lies
            qi = qs[:, :, i].unsqueeze(2)                                       # [B, T, 1, G, D]
            kp = past_k[i][:, :p].reshape(b, 1, chunks, n, self.d)               # [B, 1, chunks, K, D]: T broadcast
            vp = past_v[i][:, :p].reshape(b, 1, chunks, n, self.d)
            kt = torch.cat([past_k[i][:, p:], k[:, :, i]], 1).reshape(b * r, self.d).index_select(0, flat)
            vt = torch.cat([past_v[i][:, p:], v[:, :, i]], 1).reshape(b * r, self.d).index_select(0, flat)
            kt, vt = kt.view(b, t, m, n, self.d), vt.view(b, t, m, n, self.d)    # [B, T, m, K, D]
            head = torch.matmul(qi, kp.transpose(-1, -2)) * self.scale           # [B, T, chunks, G, K]
            rest = torch.where(seen, torch.matmul(qi, kt.transpose(-1, -2)) * self.scale, float("-inf"))
            top_h, top_r = head.amax(-1, keepdim=True), rest.amax(-1, keepdim=True)   # [.., G, 1] per chunk
            e_h = torch.exp(head - top_h)
            e_r = torch.where(seen, torch.exp(rest - top_r), 0.0)              # an empty chunk: zeros
            out.append(self._combine(torch.cat([top_h, top_r], 2),
                                     torch.cat([torch.matmul(e_h, vp), torch.matmul(e_r, vt)], 2),
                                     torch.cat([e_h.sum(-1, keepdim=True), e_r.sum(-1, keepdim=True)], 2)))
        return torch.stack(out, 2).reshape(b, t, self.h * self.d)              # [B, T, Hkv, G, D]

    @staticmethod
    def _combine(top, part, total):
        """A row's chunks (axis 2: max [.., G, 1], product with V [.., G, D], exp-sum [.., G, 1])
        combined in order: rescaled to the largest max, then summed by running sums."""
        best = top.amax(2, keepdim=True)
        best = torch.where(best == float("-inf"), 0.0, best)                    # a row that sees nothing
        weight = torch.exp(top - best)
        # Summed over the chunks in order: a running sum (CumSum) is sequential by definition, where
        # ONNX Runtime's ReduceSum regroups by the chunk count (measured: 5 of 568 rows off)
        total = torch.cumsum(total * weight, 2)[:, :, -1]
        return torch.cumsum(part * weight, 2)[:, :, -1] / torch.where(total > 0, total, 1.0)   # [B, T, G, D]


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.tanh_gelu = spec.hidden_act == "gelu_pytorch_tanh"          # Gemma's GeGLU

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class Experts(nn.Module):
    """The experts' weights stacked: gate_proj and up_proj [E, I, H], down_proj [E, H, I]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
        self.gate_proj, self.up_proj = nn.Parameter(torch.empty(e, i, h)), nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class MoE(nn.Module):
    """Routed experts (Qwen3-MoE): the router's softmax over the experts, each row's top k, their
    probabilities (renormalized where norm_topk_prob) weighting the experts'
    SwiGLU outputs. Every row gathers its own k experts' weights and multiplies them alone (batched
    products of one row each): a row's result depends on its own input only, so a tree row routes
    and computes as the same token does alone, whatever shares its forward. The cost: k experts'
    weights read per row, shared or not (a tree whose rows pick the same experts reads them again;
    `budget: auto` prices trees from measured step costs)."""

    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)       # the router
        self.experts = Experts(spec)
        self.k, self.renorm = spec.experts_per_token, spec.norm_topk_prob
        self.layer, self.fused = index, False    # fused: one node for the build to replace (export/experts_op.py)

    def forward(self, x):                                        # [B, T, H]
        if self.fused:
            from .experts_op import experts
            return experts(x, self.gate(x), self.layer)
        probs = torch.softmax(self.gate(x).float(), dim=-1)      # [B, T, E], fp32 as transformers
        weight, chosen = torch.topk(probs, self.k, dim=-1)       # [B, T, k]
        if self.renorm:
            weight = weight / weight.sum(-1, keepdim=True)
        weight = weight.to(x.dtype)
        e, flat = self.experts, chosen.reshape(-1)
        rows = x[:, :, None, :, None]                            # [B, T, 1, H, 1]

        def picked(w):          # [B, T, k, out, in]: one Gather (a quantized build gathers from blocks)
            return torch.index_select(w, 0, flat).reshape(*chosen.shape, *w.shape[1:])
        gate = torch.matmul(picked(e.gate_proj), rows).squeeze(-1)          # [B, T, k, I]
        up = torch.matmul(picked(e.up_proj), rows).squeeze(-1)
        out = torch.matmul(picked(e.down_proj), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)   # [B, T, k, H]
        out = out * weight.unsqueeze(-1)
        total = out[:, :, 0]        # summed slot by slot: ONNX Runtime's ReduceSum over the slots takes
        for j in range(1, self.k):  # another order for one row than for several (measured: lab/moe_tree_cost.py)
            total = total + out[:, :, j]
        return total


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MoE(spec, index) if spec.has_experts(index) else MLP(spec)
        self.windowed = spec.windowed(index)     # attends over the sliding window, with the local rotary
        self.input_layernorm = norm(spec, spec.hidden_size)
        self.post_attention_layernorm = norm(spec, spec.hidden_size)
        self.sandwich = spec.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(spec, spec.hidden_size)
            self.post_feedforward_layernorm = norm(spec, spec.hidden_size)

    def feed_forward(self, x, h):
        """The residual stream `x` after the attention output `h`: h added, then the MLP block."""
        if self.sandwich:                        # Gemma: each block's output normed before its residual
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Layer(spec, i) for i in range(spec.num_layers))
        self.norm = norm(spec, spec.hidden_size)


class Decoder(nn.Module):
    """The step contract as a torch module (see the module docstring)."""
    # Also return the rows the LM head reads (after the final norm): the hidden rows a drafting head
    # reads (export/contract.py). Off by default: the step contract's outputs stay logits and KV.
    hidden_rows = False

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)
        if spec.local_rope_theta:                              # Gemma 3: the windowed layers' rotary
            self.register_buffer("local_inv_freq", rope_inv_freq(spec, local=True), persistent=False)
        self.rope_scale = rope_attention_factor(spec)          # yarn's; 1.0 leaves the graph as it was

    def reset_rotary(self) -> "Decoder":
        """The rotary frequencies as real fp32 buffers (after a meta or fake construction, or a cast)."""
        self.inv_freq = rope_inv_freq(self.spec)
        if self.spec.local_rope_theta:
            self.local_inv_freq = rope_inv_freq(self.spec, local=True)
        return self

    def rotary(self, inv_freq, position_ids, dtype, scale: float = 1.0):
        """(cos, sin) [B, T, 1, R] of the positions, times `scale` (yarn's attention factor), in `dtype`;
        with fused_rotary, (cos, sin, rows): the halves [B·T, R/2] and rows [B, T] indexing them."""
        freqs = position_ids.float().unsqueeze(-1) * inv_freq         # [B, T, R/2], fp32 like HF (R: rope_dim)
        if self.model.layers[0].self_attn.fused_rope:
            b, t = position_ids.shape
            cos, sin = freqs.reshape(b * t, -1).cos(), freqs.reshape(b * t, -1).sin()
            rows = torch.arange(b * t, device=position_ids.device).view(b, t)
        else:
            emb = torch.cat([freqs, freqs], -1).unsqueeze(2)          # [B, T, 1, R]
            cos, sin, rows = emb.cos(), emb.sin(), None
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return (cos.to(dtype), sin.to(dtype)) + (() if rows is None else (rows,))

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.model.layers[0].self_attn.acc or self.model.embed_tokens.weight.dtype

    def zero_past(self, batch: int = 1, rows: int = 0) -> list[torch.Tensor]:
        """A past of `rows` zero rows in the contract's layout (2L·Hkv tensors [batch, rows, D])."""
        s = self.spec
        return [torch.zeros(batch, rows, s.head_dim, dtype=self.kv_dtype) for _ in range(2 * s.num_layers * s.num_kv_heads)]

    def exact_attention(self, dtype: torch.dtype | None = torch.float64) -> "Decoder":
        """Attention (and the KV cache) in `dtype`: float64 for targets whose MatMuls quantize their
        activations to int8, so that a tree row gives the logits of a one-token forward."""
        for layer in self.model.layers:
            layer.self_attn.acc = dtype
        return self

    def fused_experts(self) -> "Decoder":
        """Each MoE layer's experts as one exported node (export/experts_op.py), which a quantized
        streaming build replaces by ONNX Runtime's quantized experts; the module no longer runs."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.fused = True
        return self

    def fused_rotary(self) -> "Decoder":
        """Rotary as one node per tensor, com.microsoft.RotaryEmbedding (export/rotary_op.py): for
        graphs only ONNX Runtime runs (a quantized build's); the plain form otherwise."""
        for layer in self.model.layers:
            layer.self_attn.fused_rope = True
        return self

    def logical_attention(self, chunk: int = LOGICAL_CHUNK) -> "Decoder":
        """Attention by logical order in the weights' dtype (Attention.logical): with products whose
        rows do not depend on the row count (MatMulNBits at int8 activations), a tree row gives the
        logits of the same token decoded alone, bit for bit, without fp64."""
        for layer in self.model.layers:
            layer.self_attn.chunk, layer.self_attn.acc = chunk, None
        return self

    def forward(self, input_ids, position_ids, attn_mask, logit_rows, past: list[torch.Tensor]):
        """The step contract's forward (engines/fused_step.py is the same step over the KV pool in place)."""
        x = self.model.embed_tokens(input_ids)                        # [B, T, hidden]
        if self.spec.family.embed_scale:                              # Gemma: times sqrt(hidden), in x's dtype
            x = x * torch.tensor(self.spec.hidden_size ** 0.5, dtype=x.dtype)
        rope = {False: self.rotary(self.inv_freq, position_ids, x.dtype, self.rope_scale)}
        # Additive masks in fp32, [B, 1, 1, T, C+T]; a large finite negative keeps fully masked
        # (padding) rows finite. Windowed layers see each row's last `sliding_window` keys.
        masks = {False: torch.where(attn_mask, 0.0, -1e30).to(torch.float32)[:, None, None]}
        if any(layer.windowed for layer in self.model.layers):
            if hasattr(self, "local_inv_freq"):
                rope[True] = self.rotary(self.local_inv_freq, position_ids, x.dtype)     # unscaled
            near = window_mask(attn_mask, self.spec.sliding_window)
            masks[True] = torch.where(near, 0.0, -1e30).to(torch.float32)[:, None, None]
        chunk = self.model.layers[0].self_attn.chunk
        if chunk:                            # logical order: each row's keys, listed once per mask
            lists = [(False, attn_mask)] + ([(True, near)] if True in masks else [])
            keys = {w: logical_keys(m, chunk) for w, m in lists}
            c = past[0].shape[1] if past else 0
            masks = {w: (idx, valid, in_place_chunks(idx, valid, chunk, c)) for w, (idx, valid) in keys.items()}
        new_kv: list[torch.Tensor] = []
        n = self.spec.num_kv_heads
        for i, layer in enumerate(self.model.layers):
            y = layer.input_layernorm(x)
            pair = rope.get(layer.windowed, rope[False])
            ks, vs = past[2 * i * n:(2 * i + 1) * n], past[(2 * i + 1) * n:(2 * i + 2) * n]
            h, k, v = layer.self_attn(y, pair, masks[layer.windowed], ks, vs)
            new_kv += [*k, *v]
            x = layer.feed_forward(x, h)
        rows = logit_rows.unsqueeze(-1).expand(-1, -1, x.shape[-1])   # [B, R, hidden]
        x = self.model.norm(torch.gather(x, 1, rows))
        if self.hidden_rows:
            return self.lm_head(x).float(), new_kv, x.float()
        return self.lm_head(x).float(), new_kv

    @classmethod
    @torch.no_grad()
    def from_state(cls, spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype) -> "Decoder":
        """Build from HF-named weights (lm_head may be absent when tied), cast to `dtype`.

        Built on the meta device and assigned, so a 1.5B model never exists twice in memory."""
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if spec.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        with torch.device("meta"):
            model = cls(spec)
        own = model.state_dict()
        wanted = [k for k in own if not (spec.tie_word_embeddings and k == "lm_head.weight")]
        missing = [k for k in wanted if k not in state]
        unexpected = [k for k in state if k not in own]
        if missing or unexpected:
            raise SpecError(f"checkpoint does not match the {spec.arch} layout: missing {missing[:4]}, "
                            f"unexpected {unexpected[:4]}")
        for k in wanted:
            if tuple(own[k].shape) != tuple(state[k].shape):
                raise SpecError(f"weight {k} has shape {tuple(state[k].shape)}, expected {tuple(own[k].shape)}")
        model.load_state_dict({k: state[k].to(dtype) for k in wanted}, strict=False, assign=True)
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.reset_rotary()                  # stays fp32 whatever the weight dtype
        return model.eval().requires_grad_(False)
