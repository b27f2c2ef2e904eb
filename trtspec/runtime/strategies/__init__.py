"""Decoding strategies, by name. Each file holds one strategy; all share the same machinery."""
from __future__ import annotations

from .ar import Autoregressive
from .base import Strategy
from .cascade import Cascade
from .chain import ChainSpeculative
from .dyspec import DySpec
from .gsd import GSD
from .ngram import NGramSpeculative
from .staged import Staged

STRATEGIES: dict[str, type[Strategy]] = {
    "ar": Autoregressive,
    "chain": ChainSpeculative,
    "ngram": NGramSpeculative,
    "staged": Staged,
    "dyspec": DySpec,
    "gsd": GSD,
    "cascade": Cascade,
}


def make_strategy(name: str, **options) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[name](**options)
    except TypeError as e:
        raise ValueError(f"bad options for strategy {name!r} in the config: {e}") from None


__all__ = ["Strategy", "STRATEGIES", "make_strategy", "Autoregressive", "ChainSpeculative", "NGramSpeculative",
           "Staged", "DySpec", "GSD", "Cascade"]
