"""The ar gate: whether a step drafts at all, from the running gain of drafted steps, with back-off.

A step whose history says no tree pays is a plain `ar` step (budget 0, `drafted` false), probing
again after 1, 2, 4, ... 16 such steps (64 after a probe whose tree stayed empty; times the batch's
rows: a probe pads every row of the batch). Before any of that, a step drafts only if some tree
could pay at the batch's costs with an optimistic draft (the budget's `could_pay`): in a batch of
many one-token rows none can, so a full batch runs ar with no probes.
"""
from __future__ import annotations

from typing import Callable

EMA = 0.3              # weight of the newest step in the running gain of drafted steps
MAX_BACKOFF = 16       # at most this many ar steps in a row before a probe step drafts again ...
IDLE_BACKOFF = 64      # ... or this many after a probe whose tree was empty (it learned nothing)


class ArGate:
    def __init__(self) -> None:
        self.gain: float | None = None      # running (EMA) realized gain of drafted steps over ar
        self.ar_run, self.backoff = 0, 1
        self.idle = False                   # the last drafted step added no node
        self.drafting = False               # this step's decision

    def decide(self, could_pay: Callable[[], bool], rows: int) -> bool:
        """Draft this step? `could_pay`: whether any tree could pay at this batch's costs; `rows`: the
        batch's rows (a probe pads every one of them)."""
        self.drafting = self.gain is None or self.gain >= 1.0
        if (self.drafting or self.ar_run >= self.backoff) and not could_pay():
            self.drafting = False                       # not in this batch, whatever the draft: ar,
            self.ar_run += 1                            # and a probe waits for the batch to drain
            return False
        if self.drafting:
            self.ar_run, self.backoff = 0, 1
        elif self.ar_run >= self.backoff:               # probe: draft once to re-measure acceptance
            self.drafting, self.ar_run = True, 0
            # one whose tree stayed empty paid a draft forward (catching up) for nothing: rarer still
            cap = IDLE_BACKOFF if self.idle else MAX_BACKOFF
            self.backoff = min(2 * self.backoff, cap * rows)
        else:
            self.ar_run += 1
        return self.drafting

    def observe(self, realized: float, nodes: int) -> None:
        """A verified step's realized gain over ar (by the cost model) and its tree's size."""
        if self.drafting:
            self.idle = nodes == 0
            self.gain = realized if self.gain is None else (1 - EMA) * self.gain + EMA * realized
