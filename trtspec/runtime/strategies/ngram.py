"""ngram: chain decoding whose drafts come from the n-gram drafter (no draft model, ~µs drafts)."""
from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from ...options import TreeSize
from ..decode import DecodeState
from ..ngram import NGramDrafter
from ..proposal import NGRAM, Proposal
from ..runner import Calls
from ..tree import TokenTree
from .base import Strategy


class NGramSpeculative(Strategy):
    """Chain decoding with the statistical n-gram drafter: no draft model, drafts cost ~µs."""
    name = "ngram"

    def __init__(self, k: TreeSize = 8, min_ngram: Annotated[int, Field(ge=1, le=32)] = 1,
                 drafter: NGramDrafter | None = None):
        self.k = self.nodes = k
        # min_ngram > 1 drafts only on longer matches: where verifying extra tokens is not free
        # (a CPU step over T tokens costs more than one over 1), junk drafts cost real time.
        self.drafter = drafter or NGramDrafter(min_ngram=min_ngram)

    def propose(self, st: DecodeState) -> Calls:
        tree = TokenTree.chain(st.root, self.drafter.propose(st.tokens(), self.k))
        return Proposal(tree, source=np.full(len(tree), NGRAM, dtype=np.int64))
        yield                                       # noqa: unreachable: a coroutine with no model call
