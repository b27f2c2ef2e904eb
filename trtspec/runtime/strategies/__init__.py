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


def split_spec(spec: str) -> tuple[str, dict]:
    """A strategy with option overrides, as run, bench and submit() name them: "staged:budget=12:width=4"
    -> ("staged", {"budget": 12, "width": 4}); values: int, float, else a YAML scalar (true, auto, ...)."""
    import yaml
    name, *pairs = spec.split(":")
    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"strategy {spec!r}: options are written NAME:KEY=VALUE[:KEY=VALUE], e.g. staged:budget=12")
        for parse in (int, float, yaml.safe_load):
            try:
                options[key.strip()] = parse(value)
                break
            except (ValueError, yaml.YAMLError):
                continue
    return name, options


def resolve(spec: str, configured: dict[str, dict]) -> tuple[str, dict]:
    """(name, options) of a strategy spec: the config's options for that strategy, then the overrides."""
    name, overrides = split_spec(spec)
    return name, {**(configured.get(name) or {}), **overrides}


def make_strategy(name: str, /, **options) -> Strategy:
    """The strategy `name` with `options` (checked: a bad one is a ConfigError naming it; an option
    called `name` too, positional-only as `name` is)."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](**options)


__all__ = ["Strategy", "STRATEGIES", "make_strategy", "resolve", "split_spec", "Autoregressive", "ChainSpeculative", "NGramSpeculative",
           "Staged", "DySpec", "GSD", "Cascade"]
