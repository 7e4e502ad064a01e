"""Fault injection at every activation stage of every pool: the store must come back exactly as it
was (pools, pages, address spaces, handles, host and device block tables), the source checkpoint
included, and a retry without the fault must then succeed.  The scenarios: from the root, a Fork, a
Move, and a prefix of the checkpoint released by the activation (``source_tokens``: a Fork of the
prefix, then the release)."""

import numpy as np
import pytest

from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import ACTIVATION_STAGES, KVStore
from ninfer_kv.store.activation import PREFIX_LOOKAHEAD

from .helpers import CONFIGS, assert_same, space_content_ok, sync, tiny_plan, write_tokens


class InjectedFault(RuntimeError):
    pass


class FaultAt:
    """Raise at one (stage, pool) of the activation pipeline; a real hook the store calls."""

    def __init__(self, stage, pool):
        self.stage, self.pool, self.seen = stage, pool, []

    def __call__(self, stage, pool):
        self.seen.append((stage, pool))
        if stage == self.stage and pool == self.pool:
            raise InjectedFault(f"{stage}/{pool}")


def _prepared(backend):
    """A store with a live sequence and a checkpoint at a non-aligned frontier in every pool."""
    store = KVStore(tiny_plan(backend, pages=12))
    h = store.activate(100, 20)
    for kind in store.pool_kinds:
        store.map(h, 100, pool=kind)
        write_tokens(store, kind, store.row(h), 0, np.arange(1, 101, dtype=np.float32))
        store.commit(h, 100, pool=kind)
    ck = store.finish(h, retain=True)
    other = store.activate(30, 10)
    store.map(other, 40)
    store.commit(other, 30)
    sync(store)
    return store, ck


def _points(store):
    pts = []
    for stage in ACTIVATION_STAGES:
        if stage in ("lease_rows", "publish_active"):
            pts.append((stage, None))
        else:
            pts.extend((stage, kind) for kind in store.pool_kinds)
    return pts


SCENARIOS = {
    "root": dict(prompt=64, budget=30, source=False, release=False),
    "fork": dict(prompt=110, budget=30, source=True, release=False),
    "move": dict(prompt=100, budget=30, source=True, release=True),
    "prefix": dict(prompt=80, budget=30, source=True, release=True, tokens=70),
}


@pytest.mark.parametrize("backend", sorted(CONFIGS))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_activation_rolls_back_at_every_stage(backend, scenario):
    store, ck = _prepared(backend)
    sc = SCENARIOS[scenario]
    source = ck if sc["source"] else None
    cut = sc.get("tokens")
    points = _points(store)
    assert len(points) == 6 * len(store.pool_kinds) + 2
    for stage, pool in points:
        before = store.snapshot()
        store.fault_injector = FaultAt(stage, pool)
        with pytest.raises(InjectedFault):
            store.activate(sc["prompt"], sc["budget"], source=source, source_tokens=cut, release_source=sc["release"])
        assert (stage, pool) in store.fault_injector.seen
        store.fault_injector = None
        assert_same(before, store.snapshot(), f"after fault at {stage}/{pool}")
        store.audit_invariants()
    # the source checkpoint still holds its content, and the real activation now succeeds
    for kind in store.pool_kinds:
        space = store.address_space(ck, kind)
        assert space_content_ok(store, kind, space.physical_pages, list(range(1, 101)))
    h = store.activate(sc["prompt"], sc["budget"], source=source, source_tokens=cut, release_source=sc["release"])
    store.audit_invariants()
    for kind in store.pool_kinds:
        space = store.address_space(h, kind)
        expect = list(range(1, 101)) if source is not None else []
        if cut is not None:
            expect = expect[: cut - PREFIX_LOOKAHEAD.get(kind, 0)]
        assert space.committed_frontier == len(expect)
        sync(store)
        assert space_content_ok(store, kind, space.physical_pages, expect)
    assert (ck in store.checkpoints()) == (not sc["release"])


def test_fault_hook_sees_every_stage_in_order():
    store, ck = _prepared("mtp")
    seen = []
    store.fault_injector = lambda stage, pool: seen.append((stage, pool))
    store.activate(110, 10, source=ck)
    assert seen == _points(store)
    assert [s for s, _ in seen if _ is None] == ["lease_rows", "publish_active"]
    assert seen[0] == ("claim_spaces", PoolKind.MAIN)
