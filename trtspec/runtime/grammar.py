"""Structured outputs: a grammar the output must match (a JSON schema, any JSON object, a regex, a
Lark grammar), compiled by llguidance, and its token masks over a tree.

Why llguidance and not xgrammar (measured on this project's machine, docs/benchmarks.md
"Structured outputs"): both mask a token in microseconds (llguidance 10-13 us median, at most
1.4 ms; xgrammar 1-2 us, at most 0.09 ms; a target step is 50-200 ms), but llguidance compiles a
new JSON schema in 1.3-1.7 ms against xgrammar's 3.3-15.9 ms (every request may bring its own
schema), and it depends on nothing, where xgrammar's wheel pulls torch, transformers and triton.

- `Grammar`: a request's spec (immutable, part of SamplingParams).
- `Grammars`: a Generator's compiler. The llguidance tokenizer is built once, at the first grammar
  (about 1 s for Qwen's 152k tokens); `start` checks a grammar and returns a fresh matcher, so a
  bad schema or regex is a RequestError in the caller.
- `GrammarState`: one request's matcher (the request owns it), having consumed the output so far.
  `tree_masks(tree)` walks the tree depth first: at each node the mask of what may follow it, a
  child the mask forbids is marked (the step prunes it and its subtree before the target sees the
  tree), an allowed child is consumed, visited and rolled back, so each branch sees its own path
  and the state is forked without a copy. `masks(paths)` is what may follow each of a draft's
  frontier paths (the draft's distributions are masked too: DecodeState.constrain). `fit(proposal)`
  prunes what the grammar forbids from a step's tree; `mask_after(path)` and `only(row)` are what
  its drafter asks (drafters/forced.py: the tokens it forces, jump-forward). `consume(tokens)`
  consumes the emitted tokens.

The grammar's end is the generator's stop tokens (the tokenizer's EOS list): once the output is
complete they are allowed, and they are all that is allowed once nothing may follow.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import RequestError
from .proposal import Proposal
from .tree import TokenTree

KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): without it any run of whitespace is legal
# between tokens, and a model may spend its whole budget on it.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(RequestError):
    """A grammar that cannot be compiled (a bad schema, regex or Lark text)."""


@dataclass(frozen=True)
class Grammar:
    kind: str      # one of KINDS
    text: str      # the schema (JSON text), the regex or the Lark grammar; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"unknown grammar kind {self.kind!r}; choose one of: {', '.join(KINDS)}")

    def source(self) -> str:
        """The grammar in llguidance's form."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_FORMAT)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise GrammarError("the JSON schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORMAT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        return LLMatcher.grammar_from_lark(self.text)


    def check(self) -> Grammar:
        """GrammarError unless it compiles (no tokenizer needed: for checks before anything loads)."""
        from llguidance import LLMatcher

        try:
            why = LLMatcher.validate_grammar(self.source())
        except ValueError as e:
            why = str(e)
        if why:
            raise GrammarError(f"the {self.kind.replace('_', ' ')} cannot be compiled: {' '.join(why.split())[:300]}")
        return self


class Grammars:
    """Compiles requests' grammars for one tokenizer and vocabulary (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer; load the generator with one")
                if not self.stop_ids:
                    raise RequestError("structured outputs need a stop token to end the output; this model has none")
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.stop_ids)
            return self._lltok

    def start(self, grammar: Grammar) -> GrammarState:
        from llguidance import LLMatcher

        tok = self._llguidance_tokenizer()
        try:
            source = grammar.source()
        except ValueError as e:
            raise GrammarError(f"the {grammar.kind} cannot be compiled: {' '.join(str(e).split())[:300]}") from None
        matcher = LLMatcher(tok, source, log_level=0)
        if matcher.is_error():
            why = " ".join(matcher.get_error().split())[:300]
            raise GrammarError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled: {why}")
        return GrammarState(matcher, self.vocab_size, self.stop_ids)


def allowed(bits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Whether each token's bit is set in its row of an int32 bitmask [rows, ceil(V/32)]."""
    rows = np.arange(len(tokens))
    return ((bits[rows, tokens >> 5] >> (tokens & 31)) & 1).astype(bool)


def unpack(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """An int32 bitmask [rows, W] as a bool mask [rows, vocab_size] (bit j of word w: token 32w + j)."""
    return np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size].astype(bool)


class GrammarState:
    """One request's matcher: it has consumed the request's output so far (never the prompt)."""

    def __init__(self, matcher, vocab_size: int, stop_ids=()):
        self.matcher, self.vocab_size, self.stop_ids = matcher, vocab_size, frozenset(stop_ids)
        self.words = (vocab_size + 31) // 32

    def fit(self, proposal: Proposal) -> tuple[Proposal, np.ndarray]:
        """A proposal as the target may see it under this grammar, and each node's mask: nodes the
        grammar forbids pruned with their subtrees (the tokens it forces are a drafter's to add:
        drafters/forced.py)."""
        keep, masks = self.tree_masks(proposal.tree)
        if not keep.all():
            proposal, masks = proposal.subset(keep), masks[keep]
        return proposal, masks

    @staticmethod
    def only(row: np.ndarray) -> int | None:
        """The one token a mask row (int32 words) allows, or None where it allows none or several."""
        words = row.view(np.uint32)
        if int(np.bitwise_count(words).sum()) != 1:
            return None
        word = int(np.flatnonzero(words)[0])
        return 32 * word + int(words[word]).bit_length() - 1

    def mask_after(self, path: list[int]) -> np.ndarray | None:
        """The mask row (int32 words) of what may follow `path` (tokens after the output so far); None
        where the grammar does not allow the path."""
        row = np.full((1, self.words), -1, dtype=np.int32)
        allowed = self._fill_after(path, row, 0)
        self._check("masking a path")
        return row[0] if allowed else None

    def forced_after(self, path: list[int], n: int) -> list[int]:
        """The tokens the grammar forces after `path` (tokens after the output so far), one after the
        other, up to `n`: each the only one its mask allows; a stop token ends them. [] where the
        grammar does not allow the path. The matcher is back where it was after."""
        if not self._enter(path):
            return []
        row, out, consumed = np.empty((1, self.words), dtype=np.int32), [], len(path)
        while len(out) < n:
            self._fill(row, 0)
            tok = self.only(row[0])
            if tok is None or tok >= self.vocab_size:
                break
            out.append(tok)
            if tok in self.stop_ids or not self.matcher.consume_token(tok):
                break                                 # a stop token ends the output: never consumed
            consumed += 1
        self._leave(consumed)
        self._check("following forced tokens")
        return out

    def _fill_after(self, path: list[int], bits: np.ndarray, row: int) -> bool:
        """Row `row` of `bits`: what may follow `path`; False (the row left as it was) where the grammar
        does not allow the path. The matcher is back where it was after."""
        if not self._enter(path):
            return False
        self._fill(bits, row)
        self._leave(len(path))
        return True

    def _enter(self, path: list[int]) -> bool:
        """Consume `path` if the grammar allows it (False, nothing consumed, where it does not); the
        caller gives the tokens back with _leave."""
        m = self.matcher
        if path and m.validate_tokens(path) < len(path):
            return False
        if path:
            m.consume_tokens(path)
        return True

    def _leave(self, consumed: int) -> None:
        if consumed:
            self.matcher.rollback(consumed)

    def _check(self, doing: str) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher failed while {doing}: {self.matcher.get_error()}")

    def _fill(self, bits: np.ndarray, row: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(bits[row:].ctypes.data, bits[row].nbytes)

    def tree_masks(self, tree: TokenTree) -> tuple[np.ndarray, np.ndarray]:
        """(keep [N] bool, bitmask [N, W] int32): which nodes the grammar allows (a node is kept when
        its token is allowed after its parent's path, and its parent is kept; the root always is),
        and each kept node's mask of the tokens that may follow it (all ones where not computed)."""
        n = len(tree)
        bits = np.full((n, self.words), -1, dtype=np.int32)
        keep = np.zeros(n, dtype=bool)
        keep[0] = True
        kids = tree.children()
        tokens = tree.host_tokens
        m = self.matcher

        def visit(node: int) -> None:
            self._fill(bits, node)
            if m.is_stopped():
                return                                    # nothing follows: children are never emitted
            for child in kids[node]:
                tok = int(tokens[child])
                if allowed(bits[node:node + 1], np.array([tok]))[0]:
                    keep[child] = True
                    m.consume_token(tok)
                    visit(child)
                    m.rollback(1)

        visit(0)
        self._check("walking a tree")
        return keep, bits

    def masks(self, paths: list[list[int]]) -> np.ndarray:
        """bool [len(paths), V]: what may follow each path (tokens after the output so far), for the
        draft's own distributions; all True for a path the grammar does not allow (such a node is
        pruned before verification anyway)."""
        bits = np.full((len(paths), self.words), -1, dtype=np.int32)
        for i, path in enumerate(paths):
            self._fill_after(path, bits, i)
        self._check("masking drafts")
        return unpack(bits, self.vocab_size)

    def consume(self, tokens: list[int]) -> None:
        """Consume emitted tokens (each was allowed by the mask verification used)."""
        for tok in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(tok)):
                raise RuntimeError(f"grammar refused emitted token {tok}: {self.matcher.get_error()}")
