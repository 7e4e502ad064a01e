"""Runs of adjacent physical page IDs and their power-of-two chunks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.host import check_page_ids, coalesce_runs, split_runs
from ninfer_kv.host.page_id_runs import max_bucket_pages


def test_coalesce_example():
    starts, lengths = coalesce_runs([7, 8, 9, 3, 4, 12])
    assert starts.tolist() == [7, 3, 12]
    assert lengths.tolist() == [3, 2, 1]


def test_coalesce_edge_cases():
    assert [a.tolist() for a in coalesce_runs([])] == [[], []]
    assert [a.tolist() for a in coalesce_runs([5])] == [[5], [1]]
    assert [a.tolist() for a in coalesce_runs(range(10))] == [[0], [10]]
    # descending neighbours are separate runs: a run is copied in increasing physical order
    assert [a.tolist() for a in coalesce_runs([4, 3, 2])] == [[4, 3, 2], [1, 1, 1]]


@settings(max_examples=200, deadline=None)
@given(st.permutations(list(range(40))).flatmap(lambda p: st.integers(0, 40).map(lambda k: p[:k])))
def test_coalesce_reconstructs_ids(ids):
    starts, lengths = coalesce_runs(ids)
    rebuilt = [s + i for s, n in zip(starts.tolist(), lengths.tolist()) for i in range(n)]
    assert rebuilt == list(ids)
    assert all(n >= 1 for n in lengths.tolist())
    # maximal: the next run never continues the previous one
    for r in range(1, len(starts)):
        assert starts[r] != starts[r - 1] + lengths[r - 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=8), st.sampled_from([1, 2, 8, 64]), st.integers(0, 40))
def test_split_runs_power_of_two_chunks(lengths, cap, singles):
    lengths = lengths + [1] * singles  # scattered tail: single-page runs get batched
    gaps = [n + 5 for n in lengths[:-1]]
    starts = np.cumsum([0] + gaps).astype(np.int64) if lengths else np.zeros(0, np.int64)
    chunks = split_runs(starts, np.asarray(lengths, np.int64), cap)
    logical = 0
    covered = []
    for c in chunks:
        assert c.length <= cap and c.length & (c.length - 1) == 0
        assert c.count & (c.count - 1) == 0 and c.pages <= cap
        assert c.count == 1 or c.length == 1
        assert c.logical_start == logical  # chunks tile the logical range in order
        logical += c.pages
        for s in c.physical_starts:
            covered.extend(range(s, s + c.length))
    expected = [s + i for s, n in zip(starts.tolist(), lengths) for i in range(n)]
    assert covered == expected
    shapes = {(c.length, c.count) for c in chunks}
    assert len(shapes) <= 2 * (cap.bit_length() - 1) + 1
    ungrouped = split_runs(starts, np.asarray(lengths, np.int64), cap, max_group=1)
    assert all(c.count == 1 for c in ungrouped)
    assert [s + i for c in ungrouped for s in c.physical_starts for i in range(c.length)] == expected
    assert len(ungrouped) == sum(bin(n % cap).count("1") + n // cap for n in lengths)


def test_split_runs_batches_scattered_pages():
    starts, lengths = coalesce_runs([9, 3, 5, 7, 20, 21, 22, 1])
    chunks = split_runs(starts, lengths, 4)
    # runs [9] [3] [5] [7] [20..22] [1]; the 3-page run splits into 2 + 1 and its single-page
    # tail is batched with the next single-page run
    assert [(c.physical_starts, c.logical_start, c.length) for c in chunks] == [
        ((9, 3, 5, 7), 0, 1),
        ((20,), 4, 2),
        ((22, 1), 6, 1),
    ]


def test_max_bucket_pages():
    assert max_bucket_pages(1000, 64_000) == 64
    assert max_bucket_pages(1000, 100_000) == 64
    assert max_bucket_pages(10**9, 1) == 1
    assert max_bucket_pages(1, 1 << 30) == 1024
    with pytest.raises(ValueError, match="power of two"):
        split_runs(np.zeros(1, np.int64), np.ones(1, np.int64), 3)
    with pytest.raises(ValueError, match=r"max_group must be a power of two in \[1, bucket_cap=4\]"):
        split_runs(np.zeros(1, np.int64), np.ones(1, np.int64), 4, max_group=8)


def test_check_page_ids_errors():
    assert check_page_ids([3, 1, 2], 4).tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match=r"page ID 4 is out of range \[0, 4\)"):
        check_page_ids([1, 4], 4)
    with pytest.raises(ValueError, match="out of range"):
        check_page_ids([-1], 4)
    with pytest.raises(ValueError, match="page ID 2 appears more than once"):
        check_page_ids([2, 0, 2], 4)
    with pytest.raises(ValueError, match="1-D"):
        check_page_ids([[1, 2]], 4)
    with pytest.raises(TypeError, match="integers"):
        check_page_ids([1.0], 4)
