"""Sampling parameters and the logits -> probabilities transform shared by target and drafts.

Lossless means: emitted tokens are distributed exactly as the target's tokens would be under these
same parameters (temperature, then top-k, then top-p), so both sides use this one function.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import RequestError


GREEDY_BELOW = 1e-5   # temperatures this small are greedy (as in vLLM): 1/T would overflow the logits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    def __post_init__(self) -> None:
        # `not (a <= x)` rather than `x < a`, so nan (which fails every comparison) is refused too.
        if isinstance(self.temperature, bool) or not (0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_p, bool) or not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))
