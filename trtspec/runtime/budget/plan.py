"""Ledger, Round and Plan: one step's facts as its proposer records them, the one question a proposer
asks the budget in a round of drafting, and its answer (`Budget.plan`): what to take, whether to
feed, and the bar any further node of the round must pass."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Ledger:
    """One step's facts, each recorded once, where it happens: the value of every node that joined the
    tree (`value`: node -> value, the root's first, in the order they joined; a proposer grows its tree
    in this dict) and the rows of each draft forward (`forwards`, the first opened the tree; the draft
    model's tree appends them; the only count of a step's draft forwards: the step reports its
    length). The budget owns it (a fresh one each step, at `begin`) and reads it when asked (`plan`)
    and when the step ends (`observe`): no Round or Proposal carries them."""
    value: dict[int, float] = field(default_factory=lambda: {0: 1.0})
    forwards: list[int] = field(default_factory=list)

    @property
    def tree(self) -> list[float]:
        """The values of the tree's nodes but the root, in the order they joined it."""
        return list(self.value.values())[1:]

    def joined(self, values: Sequence[float]) -> None:
        """A tree assembled at once (a drafter's candidates, GSD's unrolled DAG): its nodes' values, in
        the order they joined it (the root's apart)."""
        self.value = {0: 1.0, **{i + 1: v for i, v in enumerate(values)}}


@dataclass(frozen=True)
class Round:
    """One question to the budget: the scored candidates (values by `Values`, best first) in question;
    the tree so far and the step's draft forwards so far are the step's `Ledger`, which the budget
    reads.

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
    known: Sequence[float] = ()
    feed: Sequence[float] = ()
    rows: int = 0
    width: int = 0
    ahead: int = 0
    free: bool = False
    then: int | None = None
    bar_ahead: int | None = None
    measure: bool = False


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
