"""Hooks: what the runtime tells an observer, and nothing it lets one change.

The scheduler, the batchers and the step call these at fixed points, on the scheduler's thread (or
the thread that `drive`s a coroutine). Every method is a no-op here: an observer (a lab instrument,
a server's metrics) subclasses `Hooks`, overrides what it needs, and is handed to the Generator
(`Generator(..., hooks=...)`), a Batcher or `ModelRunner.alone`. No runtime function is ever
replaced to observe it.
"""
from __future__ import annotations


class Hooks:
    def iteration(self, start: bool) -> None:
        """A scheduler iteration starts (True) or ends (False)."""

    def phase(self, name: str, requests: list, start: bool = True) -> None:
        """A phase of an iteration starts (or ends, `start` False): 'draft' (one round of draft calls),
        'target' (the target's calls) or 'read' (the waiting reads, checks and head calls, resolved
        together), over `requests`."""

    def resume(self, request) -> None:
        """The scheduler resumes `request`'s coroutine (None: it has yielded again)."""

    def section(self, state, name: str) -> None:
        """A request's step enters verification ('verify': verify_and_commit) or leaves it ('draft')."""

    def forward(self, batcher, start: bool, seconds: float = 0.0) -> None:
        """An engine forward of `batcher` starts (True) or ends (False, after `seconds`)."""


NONE = Hooks()                  # what a runtime object observes with when nobody asked
