"""Drafters, by name: the registry. Each file holds one drafter (a part that proposes candidates at
no model call, or from a head role's forward; see base.py), and the algorithm behind it (ngram.py the
max-gram matcher, suffix.py the suffix tries); adding one is its file plus one line in DRAFTERS.
Strategies name the drafters they grow trees with (`drafter: NAME`, or a list of names; the draft
model is a part of its own, draft_model.py), and the step's `sources` report counts each one's nodes
under its name.
"""
from __future__ import annotations

from ...errors import ConfigError
from .base import Candidate, Drafter, as_tree, first_chain, merged, offer_stats, offers, together
from .forced import Forced
from .medusa import Medusa
from .ngram import NGram
from .suffix import SuffixDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    "ngram": NGram,
    "suffix": SuffixDrafter,
    "medusa": Medusa,
    "grammar": Forced,
}


def make_drafter(name: str, where: str, /, **options) -> Drafter:
    """The drafter `name` with `options`; a ConfigError naming the option `where` if there is none such."""
    if name not in DRAFTERS:
        raise ConfigError(f"{where} = {name!r}: unknown drafter; choose one of: {', '.join(DRAFTERS)}")
    return DRAFTERS[name](**options)


__all__ = ["Candidate", "DRAFTERS", "Drafter", "Forced", "Medusa", "NGram", "SuffixDrafter", "as_tree",
           "first_chain", "make_drafter", "merged", "offer_stats", "offers", "together"]
