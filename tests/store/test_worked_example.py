"""The contract's worked example: a checkpoint at F = 1000 forked into 15 shared full pages plus a
private tail page holding 40 committed columns, verified on device bytes in every plane and layer."""

import numpy as np

from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import KVStore

from .helpers import P, page_bytes, planes_of, random_fill, tiny_plan, write_tokens

MAIN = PoolKind.MAIN


def _store():
    plan = tiny_plan(max_context=2048, max_concurrency=2, pages=64, profile="k8v4", head_dim=16, layers=2)
    store = KVStore(plan)
    random_fill(store, seed=1)
    return store


def _checkpoint_at(store, frontier):
    h = store.activate(frontier, 0)
    store.map(h, frontier)
    store.commit(h, frontier)
    return store.finish(h, retain=True)


def _np(store):
    return {k: np.asarray(v) for k, v in planes_of(store, MAIN).items()}


def test_fork_at_1000_shares_15_pages_and_copies_a_40_column_tail():
    store = _store()
    ck = _checkpoint_at(store, 1000)
    src_pages = store.address_space(ck).physical_pages
    assert src_pages.size == 16
    before = _np(store)
    axis = store.layout(MAIN).order.page_axis
    assert set(before) == {"k", "k_scale", "v", "v_scale"}

    h = store.activate(1000, 100, source=ck)
    space = store.bundle(h).main
    assert space.committed_frontier == 1000  # never rounded down to 960
    assert space.protected_frontier == 15 * P
    pages = space.pages()
    assert len(pages) == 16
    assert [p.references for p in pages[:15]] == [2] * 15
    assert all(p.writer_row is None and p.immutable and p.committed_columns == P for p in pages[:15])
    assert np.array_equal(space.physical_pages[:15], src_pages[:15])
    tail = pages[15]
    assert tail.references == 1 and tail.writer_row == store.row(h) and tail.committed_columns == 40
    tail_id = int(space.physical_pages[15])
    assert tail_id not in set(src_pages.tolist())

    after = _np(store)
    for name in before:
        src = np.take(before[name], int(src_pages[15]), axis=axis)
        new_before = np.take(before[name], tail_id, axis=axis)
        new_after = np.take(after[name], tail_id, axis=axis)
        # (Lyr, H, P, X): the first 40 columns equal the source tail in every layer, the rest untouched
        assert new_after[:, :, :40].tobytes() == src[:, :, :40].tobytes(), name
        assert new_after[:, :, 40:].tobytes() == new_before[:, :, 40:].tobytes(), name
    for p in range(store.pool(MAIN).capacity):
        if p != tail_id:
            assert page_bytes(after, axis, p) == page_bytes(before, axis, p), f"page {p} changed"

    # appending continues in the private tail: no new page until column 64
    assert store.map(h, 1024) == 0
    write_tokens(store, MAIN, store.row(h), 1000, np.full(24, 3.0))
    store.commit(h, 1024)
    after_append = _np(store)
    for p in src_pages.tolist():
        assert page_bytes(after_append, axis, p) == page_bytes(before, axis, p), f"source page {p} changed"
    tail_now = np.take(after_append["k"], tail_id, axis=axis)
    assert tail_now[:, :, :40].tobytes() == np.take(before["k"], int(src_pages[15]), axis=axis)[:, :, :40].tobytes()
    assert np.all(tail_now[:, :, 40:64].astype(np.float32) == 3.0)
    assert store.map(h, 1025) == 1
    assert store.checkpoint(ck).frontiers[MAIN] == 1000
    assert [p.references for p in store.address_space(ck).pages()] == [2] * 15 + [1]
    store.audit_invariants()


def test_move_continues_in_place_without_copy():
    store = _store()
    ck = _checkpoint_at(store, 1000)
    src_pages = store.address_space(ck).physical_pages
    before = _np(store)
    h = store.activate(1000, 100, source=ck, release_source=True)
    space = store.bundle(h).main
    assert np.array_equal(space.physical_pages, src_pages)  # same pages, same identity
    assert space.protected_frontier == 0 and space.committed_frontier == 1000
    assert all(p.references == 1 and p.writer_row == store.row(h) for p in space.pages())
    after = _np(store)
    for name in before:
        assert after[name].tobytes() == before[name].tobytes()  # no copy at all
    assert store.checkpoints() == []
    write_tokens(store, MAIN, store.row(h), 1000, np.full(10, 3.0))
    store.commit(h, 1010)
    assert space.pages()[15].committed_columns == 50
    store.audit_invariants()


def test_aligned_fork_has_no_tail_copy():
    store = _store()
    ck = _checkpoint_at(store, 960)
    before = _np(store)
    h = store.activate(960, 10, source=ck)
    space = store.bundle(h).main
    assert space.num_blocks == 15 and space.committed_frontier == 960
    after = _np(store)
    for name in before:
        assert after[name].tobytes() == before[name].tobytes()
    assert store.map(h, 961) == 1
    assert space.pages()[15].references == 1
    store.audit_invariants()
