"""MaxGram: longest-suffix match semantics against a naive O(n^2) reference."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from trtspec.runtime.drafters.ngram import MaxGram


def arr(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Naive reference
# ---------------------------------------------------------------------------------------------

def naive_match(seq, max_ngram=32, min_ngram=1, occurrence="latest") -> int:
    """Longest suffix (length <= max_ngram) that also ends at an earlier position; -1 if none or
    shorter than min_ngram. Among occurrences of that longest suffix, the latest or earliest end."""
    seq = list(seq)
    n = len(seq)
    for length in range(min(max_ngram, n - 1), 0, -1):
        suffix = seq[n - length:]
        ends = [e for e in range(length - 1, n - 1) if seq[e - length + 1:e + 1] == suffix]
        if ends:
            if length < min_ngram:
                return -1
            return max(ends) if occurrence == "latest" else min(ends)
    return -1


def naive_propose(seq, k, max_ngram=32, min_ngram=1, occurrence="latest", bigram=None) -> list[int]:
    out: list[int] = []
    while len(out) < k:
        work = list(seq) + out
        end = naive_match(work, max_ngram, min_ngram, occurrence)
        if end < 0:
            break
        out += work[end + 1:end + 1 + k - len(out)]
    while bigram is not None and len(out) < k:
        out.append(int(bigram[out[-1] if out else seq[-1]]))
    return out


# ---------------------------------------------------------------------------------------------
# Hand-written semantics
# ---------------------------------------------------------------------------------------------

def test_latest_vs_earliest_occurrence():
    seq = arr([1, 2, 9, 1, 2, 8, 5, 1, 2])          # [1, 2] ends at 1 and at 4
    assert MaxGram(occurrence="latest").match(seq) == 4
    assert MaxGram(occurrence="earliest").match(seq) == 1
    assert MaxGram(occurrence="latest").propose(seq, 1) == [8]
    assert MaxGram(occurrence="earliest").propose(seq, 1) == [9]


def test_longest_suffix_beats_a_later_shorter_one():
    seq = arr([3, 1, 2, 7, 4, 1, 2, 8, 3, 1, 2])    # [3,1,2] ends at 2; [1,2] also at 6
    assert MaxGram().match(seq) == 2
    assert MaxGram().propose(seq, 1) == [7]
    # max_ngram caps the suffix length: then the latest 2-gram occurrence wins.
    assert MaxGram(max_ngram=2).match(seq) == 6
    assert MaxGram(max_ngram=2).propose(seq, 1) == [8]


def test_no_match_gives_nothing():
    assert MaxGram().propose(arr([1, 2, 3, 4]), 5) == []
    assert MaxGram().match(arr([1, 2, 3, 4])) == -1
    assert MaxGram().propose(arr([7]), 3) == []           # too short to match anything
    assert MaxGram().match(arr([7])) == -1
    assert MaxGram().match(arr([])) == -1


def test_min_ngram_rejects_short_matches():
    seq = arr([4, 1, 2, 8, 5, 2])                    # only the 1-gram [2] recurs
    assert MaxGram().match(seq) == 2
    assert MaxGram(min_ngram=2).match(seq) == -1
    assert MaxGram(min_ngram=2).propose(seq, 4) == []


def test_copy_is_k_limited():
    seq = arr([1, 2, 3, 4, 5, 6, 1, 2])
    assert MaxGram().propose(seq, 3) == [3, 4, 5]
    assert MaxGram().propose(seq, 1) == [3]
    assert MaxGram().propose(seq, 0) == []


def test_continuation_past_end_of_sequence_researches():
    # [5, 6] matched at the start; only [7, 5, 6] follow it, so the drafter re-searches on
    # seq + drafts and keeps copying the period.
    seq = arr([5, 6, 7, 5, 6])
    assert MaxGram().propose(seq, 3) == [7, 5, 6]
    assert MaxGram().propose(seq, 6) == [7, 5, 6, 7, 5, 6]
    assert MaxGram().propose(seq, 8) == [7, 5, 6, 7, 5, 6, 7, 5]
    # A constant run: each copy can only take what follows the match, then re-searches.
    assert MaxGram().propose(arr([4, 4]), 5) == [4, 4, 4, 4, 4]


def test_propose_does_not_modify_the_sequence():
    seq = arr([5, 6, 7, 5, 6])
    before = seq.copy()
    MaxGram().propose(seq, 8)
    assert np.array_equal(seq, before)


def test_bigram_fallback():
    bigram = (np.arange(10) + 1) % 10
    d = MaxGram(bigram=bigram)
    assert d.propose(arr([1, 2, 3]), 3) == [4, 5, 6]         # no match: pure bigram chain
    assert d.propose(arr([9]), 2) == [0, 1]
    # A match fills first; with min_ngram=2 a 1-gram match does not count, so the bigram takes over.
    assert MaxGram(min_ngram=2, bigram=bigram).propose(arr([4, 1, 2, 8, 5, 2]), 3) == [3, 4, 5]
    assert d.propose(arr([1, 2, 3, 4, 5, 6, 1, 2]), 4) == [3, 4, 5, 6]


def test_bad_occurrence_rejected():
    with pytest.raises(ValueError, match="occurrence"):
        MaxGram(occurrence="first")


# ---------------------------------------------------------------------------------------------
# Against the naive reference
# ---------------------------------------------------------------------------------------------

sequences = hst.lists(hst.integers(0, 3), min_size=1, max_size=60)
options = hst.fixed_dictionaries({
    "max_ngram": hst.sampled_from([1, 2, 3, 5, 8, 32]),
    "min_ngram": hst.integers(1, 3),
    "occurrence": hst.sampled_from(["latest", "earliest"]),
})


@settings(max_examples=400, deadline=None, database=None)
@given(sequences, options)
def test_match_equals_naive(seq, opts):
    assert MaxGram(**opts).match(arr(seq)) == naive_match(seq, **opts)


@settings(max_examples=300, deadline=None, database=None)
@given(sequences, options, hst.integers(1, 12), hst.booleans())
def test_propose_equals_naive(seq, opts, k, use_bigram):
    bigram = (np.arange(4)[::-1].copy()) if use_bigram else None
    got = MaxGram(**opts, bigram=bigram).propose(arr(seq), k)
    assert got == naive_propose(seq, k, bigram=bigram, **opts)
    assert len(got) <= k
    if use_bigram:
        assert len(got) == k
    assert all(isinstance(t, int) for t in got)


@settings(max_examples=200, deadline=None, database=None)
@given(hst.lists(hst.integers(0, 1), min_size=2, max_size=200))
def test_match_long_binary_sequences(seq):
    # Long repetitive sequences: deep suffix matches, many candidate positions.
    for occ in ("latest", "earliest"):
        assert MaxGram(occurrence=occ).match(arr(seq)) == naive_match(seq, occurrence=occ)
