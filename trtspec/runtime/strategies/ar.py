"""ar: plain autoregressive decoding, the proposal of the root alone (a one-node tree)."""
from __future__ import annotations

from ..decode import DecodeState
from ..effects import Calls
from .base import Strategy


class Autoregressive(Strategy):
    name = "ar"

    def propose(self, st: DecodeState) -> Calls:
        return (yield from self.root_only(st))
