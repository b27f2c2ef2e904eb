"""Sampling parameters and the logits -> probabilities transform shared by target and drafts.

Lossless means: emitted tokens are distributed exactly as the target's tokens would be under these
same parameters (temperature, then top-k, then top-p), so both sides use this one function.

The rules that reshape the target's logits before that (penalties, `logit_bias`, `min_tokens`, a
grammar) depend on the tokens before each position, so they are applied per tree node by
logits.py; `logprobs` asks for the target's log-probabilities of the emitted tokens.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import RequestError


GREEDY_BELOW = 1e-5   # temperatures this small are greedy (as in vLLM): 1/T would overflow the logits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    # Logit rules, applied to the target's logits at every node in this order (vLLM's): repetition
    # (prompt and output tokens), frequency and presence (output tokens), logit_bias, min_tokens (stop
    # tokens masked until that many were emitted), the grammar's mask. All off by default.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    grammar: object = None     # grammar.Grammar: the output must match it
    logprobs: int | None = None   # report each emitted token's log-probability and this many alternatives

    def __post_init__(self) -> None:
        # `not (a <= x)` rather than `x < a`, so nan (which fails every comparison) is refused too.
        if isinstance(self.temperature, bool) or not (0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_p, bool) or not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.repetition_penalty < math.inf):
            raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (-math.inf < getattr(self, name) < math.inf):
                raise RequestError(f"{name} must be a finite number (0 = off), got {getattr(self, name)}")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise RequestError("logit_bias values must be finite numbers")
        if not isinstance(self.min_tokens, numbers.Integral) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, numbers.Integral) and 0 <= self.logprobs <= 20):
            raise RequestError(f"logprobs (alternatives per token) must be an integer in 0..20, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether any rule reshapes the target's logits (else verification reads them as they are)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] float32 probabilities after temperature, top-k and top-p."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_x, -1)) >= params.top_p   # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def keyed_uniforms(seed: int, positions: np.ndarray) -> np.ndarray:
    """float64 uniforms in (0, 1), one per position, each a function of (seed, position) alone
    (splitmix64 of the pair): the draw that picks a sampled request's token at that position,
    whatever tree, batch or device verifies it (verify.py)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed & (2**64 - 1)) * _MIX[0] + np.asarray(positions, dtype=np.uint64) * _MIX[1] + _MIX[0]
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] the token of each row of `probs` [N, V] that the uniform `u` [N] picks: the first whose
    cumulative mass passes u x the row's total, never one past the last token with mass.

    The cumulative sum is float64 for the draw's accuracy, not for its order (a row's draw is the
    same bit for bit in any batch either way): over 151,936 tokens an fp32 running sum samples from a
    distribution 1e-3 in total variation away from p, fp64 1e-12; it costs 2.6 ms for a 16-row tree
    against 1.5 (0.21 against 0.17 for one row) on the 2-core AMD EPYC (docs/benchmarks.md, "Hardening IV")."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    pick = torch.searchsorted(cdf, u.to(cdf.dtype).unsqueeze(1) * total, right=True)
    return torch.minimum(pick, (cdf < total).sum(-1, keepdim=True))[:, 0]


def keyed_draw(probs: torch.Tensor, seed: int, positions) -> torch.Tensor:
    """inverse_cdf of `probs` [N, V] with the keyed uniforms of `positions` [N] (one copy to probs'
    device; a caller with several draws to make copies their uniforms once: `keyed_on`)."""
    return inverse_cdf(probs, keyed_on(probs.device, seed, positions))


def keyed_on(device, seed: int, positions) -> torch.Tensor:
    """The keyed uniforms of `positions` as a float64 tensor on `device` (one host-to-device copy)."""
    return torch.from_numpy(keyed_uniforms(seed, np.asarray(positions))).to(device)
