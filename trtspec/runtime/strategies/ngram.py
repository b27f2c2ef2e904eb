"""ngram: chain decoding whose drafts come from a free drafter (no draft model, ~µs drafts): the n-gram
drafter's copy by default, any drafter's chain with `drafter: NAME` (drafters/), or with a list the
first of their chains that is not empty."""
from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from ...options import Drafters, TreeSize
from ..decode import DecodeState
from ..drafters import first_chain
from ..effects import Calls
from ..proposal import Proposal
from ..tree import TokenTree
from .base import Strategy


class NGramSpeculative(Strategy):
    """Chain decoding with the statistical n-gram drafter: no draft model, drafts cost ~µs."""
    name = "ngram"

    def __init__(self, k: TreeSize = 8, min_ngram: Annotated[int, Field(ge=1, le=32)] = 1,
                 drafter: Drafters = "ngram"):
        self.k = self.nodes = k
        # min_ngram > 1 drafts only on longer matches: where verifying extra tokens is not free
        # (a CPU step over T tokens costs more than one over 1), junk drafts cost real time.
        self.cheap_drafters(self.drafter_choice(drafter, False), only={"ngram": {"min_ngram": min_ngram}})

    def propose(self, st: DecodeState) -> Calls:
        tag, chain = first_chain(self.drafters, st, st.tokens(), self.k)
        tree = TokenTree.chain(st.root, chain)
        return Proposal(tree, source=np.full(len(tree), tag, dtype=np.int64))
        yield                                       # noqa: unreachable: a coroutine with no model call
