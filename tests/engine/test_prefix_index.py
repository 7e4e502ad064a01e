"""PrefixIndex: a stateful model check against brute force, and direct cases.

The model is a plain dict of entries with their tokens, clock, recency order and pins; every query
is answered by scanning it (common prefixes counted token by token).  Sequences are built from a
few random stems or the current entries, cut at random points and extended over a tiny vocabulary,
so prefixes collide often and matches end inside edges; clocks come from a tiny range, so recency
ties are common.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ninfer_kv.engine.prefix_index import PrefixEntry, PrefixIndex

VOCAB = 3


@dataclasses.dataclass
class Rec:
    tokens: tuple
    last_use: int
    order: int
    pins: int = 0


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def most_recent(recs: dict, entries):
    return max(entries, key=lambda e: (recs[e].last_use, recs[e].order), default=None)


clocks = st.integers(0, 4)  # a small range, so equal clocks (ties) are common


class PrefixIndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = PrefixIndex()
        self.recs: dict[PrefixEntry, Rec] = {}
        self.order = 0
        self.stems: list[list[int]] = [[0]]

    @initialize(stems=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=14), min_size=1, max_size=4))
    def make_stems(self, stems):
        self.stems = stems

    def _tokens(self, data, *, min_size=0) -> list[int]:
        """A stem or an entry's tokens, cut at a random point and extended by a few random tokens."""
        bases = self.stems + [list(r.tokens) for r in self.recs.values()]
        stem = data.draw(st.sampled_from(bases), label="base")
        cut = data.draw(st.just(len(stem)) | st.integers(0, len(stem)), label="cut")
        ext = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6), label="extension")
        tokens = stem[:cut] + ext
        return tokens if len(tokens) >= min_size else [0]

    def _stamp(self) -> int:
        self.order += 1
        return self.order

    def _entry(self, data) -> PrefixEntry | None:
        """One of the model's entries, or ``None`` when there are none (the rule then does nothing)."""
        if not self.recs:
            return None
        return data.draw(st.sampled_from(list(self.recs)), label="entry")

    # -- verbs ----------------------------------------------------------------------------------------
    @rule(data=st.data(), now=clocks, as_array=st.booleans())
    def insert(self, data, now, as_array):
        tokens = self._tokens(data, min_size=1)
        t = tuple(tokens)
        arg = np.array(tokens, dtype=np.int32) if as_array else tokens
        # As a serving engine would: match the new sequence first, then insert it.
        self._check_match(arg, None)
        self._check_covered(t)
        if self._check_covering(t) is not None:
            with pytest.raises(ValueError, match="covered"):
                self.index.insert(arg, "v", now=now)
            return
        entry = self.index.insert(arg, ("v", t), now=now)
        assert entry.value == ("v", t)
        self.recs[entry] = Rec(t, now, self._stamp())

    @rule(data=st.data())
    def remove(self, data):
        entry = self._entry(data)
        if entry is None:
            return
        if self.recs[entry].pins:
            with pytest.raises(ValueError, match="pinned"):
                self.index.remove(entry)
            return
        self.index.remove(entry)
        del self.recs[entry]
        assert entry not in self.index
        with pytest.raises(ValueError):
            self.index.touch(entry, 0)

    @rule(data=st.data(), now=clocks)
    def touch(self, data, now):
        entry = self._entry(data)
        if entry is None:
            return
        self.index.touch(entry, now)
        self.recs[entry].last_use = now
        self.recs[entry].order = self._stamp()

    @rule(data=st.data())
    def pin(self, data):
        entry = self._entry(data)
        if entry is None:
            return
        self.index.pin(entry)
        self.recs[entry].pins += 1

    @rule(data=st.data())
    def unpin(self, data):
        entry = self._entry(data)
        if entry is None:
            return
        rec = self.recs[entry]
        if rec.pins == 0:
            with pytest.raises(ValueError):
                self.index.unpin(entry)
            return
        self.index.unpin(entry)
        rec.pins -= 1

    @rule()
    def remove_all(self):
        for entry, rec in self.recs.items():
            for _ in range(rec.pins):
                self.index.unpin(entry)
            self.index.remove(entry)
            self.index.check()
        self.recs.clear()

    # -- queries --------------------------------------------------------------------------------------
    def _check_match(self, tokens, limit):
        entry, n = self.index.longest_match(tokens, limit)
        q = tuple(int(x) for x in (tokens if limit is None else tokens[:limit]))
        best = max((lcp(r.tokens, q) for r in self.recs.values()), default=0)
        assert n == best
        if best == 0:
            assert entry is None
        else:
            tied = [e for e, r in self.recs.items() if lcp(r.tokens, q) == best]
            assert entry is most_recent(self.recs, tied)

    def _check_covering(self, t: tuple) -> PrefixEntry | None:
        want = most_recent(self.recs, [e for e, r in self.recs.items() if r.tokens[: len(t)] == t])
        assert self.index.covering(t) is want
        return want

    def _check_covered(self, t: tuple) -> None:
        want = sorted(
            (e for e, r in self.recs.items() if len(r.tokens) < len(t) and t[: len(r.tokens)] == r.tokens),
            key=lambda e: len(self.recs[e].tokens),
        )
        assert self.index.covered(t) == want

    @rule(data=st.data(), as_array=st.booleans())
    def longest_match(self, data, as_array):
        tokens = self._tokens(data)
        limit = data.draw(st.none() | st.integers(0, len(tokens) + 2), label="limit")
        self._check_match(np.array(tokens, dtype=np.int64) if as_array else tokens, limit)

    @rule(data=st.data())
    def covering(self, data):
        self._check_covering(tuple(self._tokens(data)))

    @rule(data=st.data())
    def covered(self, data):
        self._check_covered(tuple(self._tokens(data)))

    # -- invariants -----------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        index, recs = self.index, self.recs
        index.check()
        assert len(index) == len(recs)
        assert set(index) == set(recs)
        for entry, rec in recs.items():
            assert tuple(entry.tokens.tolist()) == rec.tokens
            assert entry.length == len(rec.tokens)
            assert (entry.last_use, entry.pins) == (rec.last_use, rec.pins)
        prefixes = {r.tokens[:i] for r in recs.values() for i in range(1, len(r.tokens) + 1)}
        assert index.num_tokens == len(prefixes)
        want = sorted((e for e, r in recs.items() if r.pins == 0), key=lambda e: (recs[e].last_use, recs[e].order))
        assert index.eviction_order() == want
        if not recs:
            assert index.num_tokens == 0
            assert not index._root.children and index._root.best is None

    def teardown(self):
        self.remove_all()
        assert len(self.index) == 0 and self.index.num_tokens == 0
        assert not self.index._root.children


TestPrefixIndexMachine = PrefixIndexMachine.TestCase
TestPrefixIndexMachine.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- direct cases -------------------------------------------------------------------------------------
def test_match_ends_mid_edge():
    index = PrefixIndex()
    a = index.insert([1, 2, 3, 4, 5], "a", now=0)
    assert index.num_tokens == 5
    assert index.longest_match([1, 2, 3, 9]) == (a, 3)
    assert index.longest_match([1, 2, 3, 4, 5, 6, 7]) == (a, 5)
    assert index.longest_match([2, 1]) == (None, 0)
    assert index.longest_match([]) == (None, 0)
    b = index.insert([1, 2, 7], "b", now=1)  # splits a's edge after two tokens
    assert index.num_tokens == 6
    index.check()
    assert index.longest_match([1, 2, 3]) == (a, 3)
    assert index.longest_match([1, 2]) == (b, 2)  # both share two tokens; b is more recent
    index.touch(a, 2)
    assert index.longest_match([1, 2, 8]) == (a, 2)
    index.touch(a, 1)  # an equal clock: the later call is more recent
    index.touch(b, 1)
    assert index.longest_match([1]) == (b, 1)
    index.check()


def test_limit_shorter_than_the_match():
    index = PrefixIndex()
    a = index.insert(list(range(10)), "a", now=0)
    assert index.longest_match(list(range(10)), 4) == (a, 4)
    assert index.longest_match(list(range(10)), 0) == (None, 0)
    assert index.longest_match(list(range(5)), 99) == (a, 5)
    with pytest.raises(ValueError):
        index.longest_match([0, 1], -1)


def test_numpy_input_is_copied_and_read_only():
    index = PrefixIndex()
    src = np.array([5, 6, 7, 8], dtype=np.int32)
    a = index.insert(src, "a", now=0)
    src[:] = 0
    assert a.tokens.dtype == np.int64 and a.tokens.tolist() == [5, 6, 7, 8]
    with pytest.raises(ValueError):
        a.tokens[0] = 1
    assert index.longest_match(np.array([5, 6, 9], dtype=np.uint16)) == (a, 2)
    assert index.covering(np.array([5, 6], dtype=np.int8)) is a
    with pytest.raises(TypeError):
        index.insert(np.array([1.0, 2.0]), "f", now=0)
    with pytest.raises(ValueError):
        index.insert(np.zeros((2, 2), np.int64), "m", now=0)
    with pytest.raises(ValueError):
        index.insert([], "e", now=0)
    index.check()


def test_long_sequences():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, 32000)
    index = PrefixIndex()
    a = index.insert(base, "a", now=0)
    other = base.copy()
    other[20000:] = rng.integers(32000, 64000, 12000)  # diverges at token 20000
    b = index.insert(other, "b", now=1)
    assert index.num_tokens == 32000 + 12000
    query = base.copy()
    query[25000] = -1
    assert index.longest_match(query) == (a, 25000)
    assert index.longest_match(query, 20000) == (b, 20000)
    assert index.longest_match(other.tolist()) == (b, 32000)
    index.check()
    index.remove(b)
    assert index.num_tokens == 32000
    index.remove(a)
    assert index.num_tokens == 0 and len(index) == 0
    index.check()


def test_covering_and_covered():
    index = PrefixIndex()
    a = index.insert([1, 2], "a", now=0)
    b = index.insert([1, 2, 3, 4], "b", now=1)  # covers a, which stays until removed
    assert index.covered([1, 2, 3, 4, 5]) == [a, b]
    assert index.covered([1, 2, 3, 4]) == [a]
    assert index.covering([1, 2, 3]) is b
    assert index.covering([1, 2]) is b  # b is more recent than a
    index.touch(a, 5)
    assert index.covering([1, 2]) is a
    assert index.covering([1, 3]) is None
    with pytest.raises(ValueError, match="covered"):
        index.insert([1, 2, 3], "c", now=2)
    with pytest.raises(ValueError, match="covered"):
        index.insert([1, 2], "c", now=2)
    index.remove(a)
    assert index.num_tokens == 4
    index.check()


def test_remove_merges_nodes():
    index = PrefixIndex()
    a = index.insert([1, 2, 3], "a", now=0)
    b = index.insert([1, 2, 4], "b", now=0)
    c = index.insert([1, 5], "c", now=0)
    assert index.num_tokens == 5  # [1] -> {[2] -> {[3], [4]}, [5]}
    index.remove(b)  # [1, 2] is left with one child and no entry: merged into [1, 2, 3]
    index.check()
    assert index.num_tokens == 4
    index.remove(c)
    index.check()
    assert index.num_tokens == 3 and index.longest_match([1, 2, 3]) == (a, 3)
    index.remove(a)
    assert index.num_tokens == 0 and not index._root.children and index._root.best is None
    index.check()


def test_pins_and_eviction_order():
    index = PrefixIndex()
    a = index.insert([1], "a", now=3)
    b = index.insert([2], "b", now=1)
    c = index.insert([3], "c", now=2)
    assert index.eviction_order() == [b, c, a]
    index.pin(b)
    index.pin(b)
    assert index.eviction_order() == [c, a]
    with pytest.raises(ValueError, match="pinned"):
        index.remove(b)
    index.unpin(b)
    assert b.pins == 1 and index.eviction_order() == [c, a]
    index.unpin(b)
    with pytest.raises(ValueError):
        index.unpin(b)
    assert index.eviction_order() == [b, c, a]
    index.remove(b)
    for verb in (index.remove, index.pin, index.unpin):
        with pytest.raises(ValueError):
            verb(b)
    assert list(index) == [a, c] and len(index) == 2
    other = PrefixIndex()
    with pytest.raises(ValueError):
        other.remove(a)


def test_check_detects_broken_invariants():
    def fresh():
        index = PrefixIndex()
        index.insert([1, 2, 3], "a", now=0)
        index.insert([1, 2, 4], "b", now=1)
        index.check()
        return index

    index = fresh()
    mid = index._root.children[1]
    mid.children[3].edge = mid.children[3].edge[:0]  # an empty edge
    with pytest.raises(AssertionError):
        index.check()

    index = fresh()
    index._num_tokens += 1
    with pytest.raises(AssertionError, match="num_tokens"):
        index.check()

    index = fresh()
    mid = index._root.children[1]
    del mid.children[4]  # leaves an entry-less node with one child (and a lost entry)
    with pytest.raises(AssertionError):
        index.check()

    index = fresh()
    index._root.children[1].best = None  # a stale most recent entry
    with pytest.raises(AssertionError, match="most recent"):
        index.check()
