"""Decoding strategies, by name: the registry. Each file holds one strategy (a proposer, see base.py);
adding one is its file plus one line in STRATEGIES.

`strategy(spec, configured, has_draft, has_hidden)` is the one place a strategy spec becomes a
checked strategy object, for the CLI, the server, `Generator` and loading alike: "staged:budget=12"
is the name, the config's options for it, then the overrides, made (options checked) and checked
runnable (with its draft, and the target's hidden rows if a drafter of it reads them).
"""
from __future__ import annotations

from ...errors import ConfigError, RequestError
from ...options import MAX_STEP_TOKENS
from .ar import Autoregressive
from .base import Strategy
from .cascade import Cascade
from .chain import ChainSpeculative
from .dyspec import DySpec
from .gsd import GSD
from .ngram import NGramSpeculative
from .staged import Staged
from .suffix import SuffixSpeculative

STRATEGIES: dict[str, type[Strategy]] = {
    "ar": Autoregressive,
    "chain": ChainSpeculative,
    "ngram": NGramSpeculative,
    "staged": Staged,
    "dyspec": DySpec,
    "gsd": GSD,
    "cascade": Cascade,
    "suffix": SuffixSpeculative,
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


# Options that make one choice two ways (`suffix: true` is `drafter: suffix`): an override of one
# drops what the config set for the other, so `staged:drafter=ngram` is the n-gram staged under a
# config that sets `suffix: true`.
SAME_CHOICE = ({"suffix", "drafter"},)


def merged(options: dict, overrides: dict) -> dict:
    """`options` with `overrides` over them (an override drops the options making its choice another way)."""
    base = dict(options)
    for group in SAME_CHOICE:
        if group & overrides.keys():
            for key in group - overrides.keys():
                base.pop(key, None)
    return {**base, **overrides}


def resolve(spec: str, configured: dict[str, dict]) -> tuple[str, dict]:
    """(name, options) of a strategy spec: the config's options for that strategy, then the overrides."""
    name, overrides = split_spec(spec)
    return name, merged(configured.get(name) or {}, overrides)


def make_strategy(name: str, /, **options) -> Strategy:
    """The strategy `name` with `options` (checked: a bad one is a ConfigError naming it; an option
    called `name` too, positional-only as `name` is)."""
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](**options)


def hidden_rows_missing(name: str, strat: Strategy) -> str:
    """Why `strat` cannot run on a target without hidden rows (the start of a one-line error)."""
    reads = [d.name for d in strat.drafters if d.reads_hidden]
    return (f"strategy {name!r} drafts with {', '.join(reads)}, which reads the target's hidden rows, and the "
            "target does not return them")


def heads_missing(name: str, strat: Strategy, kinds) -> str | None:
    """Why `strat` cannot run without more head roles than those of `kinds` (one line), or None."""
    missing = sorted(strat.reads_heads - set(kinds))
    if not missing:
        return None
    return (f"strategy {name!r} drafts with a {missing[0]} head and there is none: add heads: {{NAME: {{model: "
            f"FILE, kind: {missing[0]}}}}} to the config (with target.hidden_rows: true) and rebuild, or choose "
            "another drafter")


def check(strat: Strategy, has_draft: bool, has_hidden: bool = False, heads=(),
          max_step: int = MAX_STEP_TOKENS) -> None:
    """RequestError unless `strat` can run: its step fits one model call (`max_step` tokens: fewer
    on a target exact by one step shape, engines/exact.py), it has its draft, the target returns
    hidden rows if a drafter of it reads them, and the heads it asks are there (`heads`: the kinds of
    head role loaded)."""
    if strat.max_tree_size() > max_step:
        shape = "" if max_step == MAX_STEP_TOKENS else " on this target (exact on the GPU: every step at one shape)"
        raise RequestError(f"strategy {strat.name!r} can send {strat.max_tree_size()} tokens to the target in "
                           f"one step, more than the {max_step} a step allows{shape}; "
                           "lower its budget / k (with auto: max_budget / max_k / max_k_draft) in the config")
    if strat.needs_draft and not has_draft:
        raise RequestError(f"strategy {strat.name!r} needs a draft model, but none is loaded; "
                           "add a draft to the config or use --strategy ar / ngram")
    if strat.reads_hidden and not has_hidden:
        raise RequestError(f"{hidden_rows_missing(strat.name, strat)}: set target.hidden_rows: true in the config "
                           "and rebuild the engine folder, or choose another drafter")
    if why := heads_missing(strat.name, strat, heads):
        raise RequestError(why)


def strategy(spec: "str | Strategy", configured: dict[str, dict] | None = None, has_draft: bool = True,
             has_hidden: bool = False, heads=(), max_step: int = MAX_STEP_TOKENS, **overrides) -> Strategy:
    """The strategy a spec names ("staged", "staged:budget=12", or a Strategy object as it is): the
    configured options for it, the spec's overrides, then `overrides`; checked runnable with or
    without a draft model, with or without the target's hidden rows, with the kinds of head `heads`,
    in steps of at most `max_step` tokens."""
    if isinstance(spec, Strategy):
        strat = spec
    else:
        name, options = resolve(spec, configured or {})
        strat = make_strategy(name, **merged(options, overrides))
    check(strat, has_draft, has_hidden, heads, max_step)
    return strat


__all__ = ["Strategy", "STRATEGIES", "check", "heads_missing", "hidden_rows_missing", "make_strategy", "resolve",
           "split_spec", "strategy", "Autoregressive", "ChainSpeculative", "NGramSpeculative", "Staged",
           "DySpec", "GSD", "Cascade", "SuffixSpeculative"]
