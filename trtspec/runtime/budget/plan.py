"""Round and Plan: the one question a proposer asks the budget, and its answer (`Budget.plan`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    """One question to the budget, with the facts it needs: the tree so far and the step's draft
    forwards so far (the proposer reports them; the budget keeps no running tally of its own), and
    the scored candidates (values by `Values`, best first) in question.

    - `rows` = 0: how many of `known` to add now (`Plan.take`): the best prefix of them; with
      `ahead` > 0 the best `width` are also weighed as a frontier to feed in up to `ahead` more draft
      forwards; with `free` the candidates cost no draft forward (a suffix tree) and are taken only
      if they beat the batch all at ar.
    - `rows` > 0: whether one more draft forward over `rows` rows, feeding nodes of values `feed`
      (then up to `ahead` - 1 more), grows a better tree than the best of `known` without it
      (`Plan.feed`)."""
    tree: Sequence[float] = ()          # values of the nodes in the tree now, in the order they joined it
    forwards: Sequence[int] = ()        # rows of each draft forward this step so far (the first opened the tree)
    known: Sequence[float] = ()
    feed: Sequence[float] = ()
    rows: int = 0
    width: int = 0
    ahead: int = 0
    free: bool = False


def joined(value: dict) -> list[float]:
    """`Round.tree` from a proposer's {node: value} (node 0, the root, first; the others in the order
    they joined the tree, as a dict keeps them)."""
    return list(value.values())[1:]


@dataclass(frozen=True)
class Plan:
    take: int = 0          # how many of the round's known candidates to add
    feed: bool = False     # run the draft forward the round asked about
