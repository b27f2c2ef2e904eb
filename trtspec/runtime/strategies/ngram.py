"""ngram: chain decoding whose drafts come from a free drafter (no draft model, ~µs drafts): the n-gram
drafter's copy by default, any drafter's chain with `drafter: NAME` (drafters/)."""
from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from ...options import DrafterName, TreeSize
from ..decode import DecodeState
from ..proposal import Proposal
from ..runner import Calls
from ..tree import TokenTree
from .base import Strategy


class NGramSpeculative(Strategy):
    """Chain decoding with the statistical n-gram drafter: no draft model, drafts cost ~µs."""
    name = "ngram"

    def __init__(self, k: TreeSize = 8, min_ngram: Annotated[int, Field(ge=1, le=32)] = 1,
                 drafter: DrafterName = "ngram"):
        self.k = self.nodes = k
        # min_ngram > 1 drafts only on longer matches: where verifying extra tokens is not free
        # (a CPU step over T tokens costs more than one over 1), junk drafts cost real time.
        opts = {"min_ngram": min_ngram} if drafter == "ngram" else {}
        self.drafter = self.cheap_drafter(drafter, **opts)

    def propose(self, st: DecodeState) -> Calls:
        tree = TokenTree.chain(st.root, self.drafter.chain(st, st.tokens(), self.k))
        return Proposal(tree, source=np.full(len(tree), self.drafter.tag, dtype=np.int64))
        yield                                       # noqa: unreachable: a coroutine with no model call

    def finished(self, st: DecodeState, prompt: list[int], output: list[int]) -> None:
        self.drafter.finished(st, prompt, output)
