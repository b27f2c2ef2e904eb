"""Round and Plan: the one question a proposer asks the budget in a round of drafting, and its answer
(`Budget.plan`): what to take, whether to feed, and the bar any further node of the round must pass."""
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
      (`Plan.feed`).
    - `then` (with `rows` = 0): a draft forward follows that feeds what is taken, with `then` more
      rows (a stage-2 chain to review): whether it pays is answered too (`Plan.feed`), weighed as
      `rows` > 0 would weigh it after the take, against the next `width` of `known`.
    - `bar_ahead`: also answer the bars of nodes that join later in the round, once their values
      are known (a drawn child, a kept review token): `Plan.bars`, for up to `bar_ahead` more draft
      forwards of look-ahead below such a node.
    - `measure` (with `rows` > 0): a drafter beside the draft offers a tree every step (a head), so
      the draft's prior top-1 alone might keep it from ever being fed, so from ever being measured:
      while the request has not seen the draft's top-1, the feed is weighed with an optimistic draft
      (the gate's), and the proposer measures what that forward shows (`Values.measure_top1`)."""
    tree: Sequence[float] = ()          # values of the nodes in the tree now, in the order they joined it
    forwards: Sequence[int] = ()        # rows of each draft forward this step so far (the first opened the tree)
    known: Sequence[float] = ()
    feed: Sequence[float] = ()
    rows: int = 0
    width: int = 0
    ahead: int = 0
    free: bool = False
    then: int | None = None
    bar_ahead: int | None = None
    measure: bool = False


def joined(value: dict) -> list[float]:
    """`Round.tree` from a proposer's {node: value} (node 0, the root, first; the others in the order
    they joined the tree, as a dict keeps them)."""
    return list(value.values())[1:]


@dataclass(frozen=True)
class Plan:
    take: int = 0          # how many of the round's known candidates to add
    feed: bool = False     # run the draft forward the round asked about
    # bars[a]: the value a node joining later in the round must exceed, with `a` more draft forwards
    # of look-ahead below it; weighed alone at the tree the take and the feed leave (it does not rise
    # as the round's other late nodes join). Asked with Round.bar_ahead.
    bars: tuple[float, ...] = ()

    def joins(self, value: float, ahead: int = 0) -> bool:
        """Does a node of `value` (found after the answer: a drawn child, a kept review token) join?"""
        return value > self.bars[min(ahead, len(self.bars) - 1)]
