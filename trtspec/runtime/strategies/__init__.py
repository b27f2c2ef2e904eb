"""Decoding strategies, by name. Each file holds one strategy; all share the same machinery."""
from __future__ import annotations

from ...errors import ConfigError
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
    """The strategy `name` with `options` (checked: a bad one is a ConfigError naming it)."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](**options)


__all__ = ["Strategy", "STRATEGIES", "make_strategy", "Autoregressive", "ChainSpeculative", "NGramSpeculative",
           "Staged", "DySpec", "GSD", "Cascade"]
