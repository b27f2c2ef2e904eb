"""ar: plain autoregressive decoding, as the verification of a one-node tree (the root)."""
from __future__ import annotations

from ..decode import DecodeState
from ..runner import Calls
from ..tree import TokenTree
from .base import Strategy


class Autoregressive(Strategy):
    name = "ar"

    def step(self, st: DecodeState) -> Calls:
        return (yield from st.verify_and_commit(TokenTree.chain(st.root, [])))[0]
