"""resync: a poisoned, lagging or blank state brought back in line, checked against a model of the bytes.

One scripted serving history (root activations, a fork with a COW tail, an offload that leaves a
checkpoint Host-only, a fork from it that restores and copies, releases) runs with a slip injected at
every round work in turn — skipped, repeated, reordered — then :func:`ninfer_kv.resync` repairs the
state.  Checked after every repair, with the state's planes read back:

* every sequence and checkpoint it does not report holds exactly its committed tokens on the device
  (or in its Host replica): nothing lost is ever served as if intact;
* every reported one holds its tokens up to the intact frontier it reports;
* whatever was finished before the slip is not reported, and whatever committed after it is;
* reported sequences are refused by every verb, return to service when truncated to their intact
  frontier and then serve new tokens; the store's invariants hold and nothing leaks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.geometry import SENTINEL_PAGE
from ninfer_kv.schema.errors import LostContentError, RowError, WorkOrderError
from ninfer_kv.device import apply_work_jit, resync
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import CheckpointHandle, KVStore, SequenceHandle

from .helpers import content_ok, model_step, tiny_plan
from ninfer_kv.device import allocate_state, offload_checkpoint

MAIN = PoolKind.MAIN
T = 128
ROUNDS = 5
D = 8


def _values(base: int, start: int, n: int) -> list[float]:
    """Token values exact in bf16 (integers in [1, 250]), distinct per sequence at each position."""
    return [float(1 + (base + t) % 250) for t in range(start, start + n)]


class Serving:
    """The caller: a store, its state, a model of every sequence's and checkpoint's tokens."""

    def __init__(self, slip: str | None = None, at: int = -1):
        self.store = KVStore(
            tiny_plan(head_dim=D, pages=12, max_concurrency=3, layers=1, max_context=256), host_bytes=1 << 20
        )
        self.state = allocate_state(self.store, fill=float("nan"))
        self.slip, self.at = slip, at
        self.model: dict = {}  # handle -> committed token values
        self.base: dict = {}
        self.changed: dict = {}  # handle -> last round whose commits or page writes it depends on
        self.round = 0
        C = self.store.max_concurrency
        self.pad = (C * self.store.logical_pages, 12, 12)

    # -- the caller's verbs ---------------------------------------------------------------------------
    def activate(self, prompt: int, budget: int, base: int, source=None) -> SequenceHandle:
        h = self.store.activate(prompt, budget, source=source)
        self.model[h] = list(self.model[source]) if source is not None else []
        self.base[h] = base
        self.changed[h] = self.round if source is not None else -1  # its page writes go with this round
        if source is not None:
            self.changed[h] = max(self.changed[h], self.changed[source])
        return h

    def finish(self, h, retain: bool):
        ck = self.store.finish(h, retain=retain)
        if retain:
            self.model[ck], self.changed[ck] = self.model[h], self.changed[h]
        del self.model[h]
        return ck

    def release(self, ck) -> None:
        self.store.release_checkpoint(ck)
        del self.model[ck]

    def take(self):
        return self.store.take_work().pad_to(*self.pad)

    def run_round(self, appends: dict) -> None:
        """Map, take, step (append every sequence's next tokens), commit — with the slip if due."""
        store = self.store
        C = store.max_concurrency
        rows = np.full(C, C, np.int32)
        positions = np.zeros(C, np.int32)
        valid = np.zeros(C, np.int32)
        k = np.zeros((C, T, 1, D), np.float32)
        for i, (h, n) in enumerate(appends.items()):
            start = len(self.model[h])
            store.map(h, start + n)
            rows[i], positions[i], valid[i] = store.row(h), start, n
            k[i, :n] = np.asarray(_values(self.base[h], start, n))[:, None, None]
        work = self.take()
        step = model_step(store.layout(MAIN))
        if self.round == self.at and self.slip == "skip":
            work = self.take()  # the step gets the next work: this round's was skipped
        elif self.round == self.at and self.slip == "reorder":
            self.state = apply_work_jit(self.state, self.take())  # the next work first, then this one
        self.state = step(self.state, work, rows, positions, valid, jnp.asarray(k))
        if self.round == self.at and self.slip == "repeat":
            self.state = apply_work_jit(self.state, work)
        for h, n in appends.items():
            start = len(self.model[h])
            store.commit(h, start + n)
            self.model[h] += _values(self.base[h], start, n)
            self.changed[h] = self.round
        self.round += 1

    def restore_dropping_host(self, ck) -> None:
        """Restore ``ck``'s Host-only pages and release its Host replicas: the restore in the next work
        is then the only copy of those pages."""
        self.store.restore_checkpoint(ck, drop_host=True)
        self.changed[ck] = self.round

    def offload_and_drop(self, ck) -> None:
        """Offload ``ck`` and drop its Device pages; a poisoned state refuses (nothing changes)."""
        try:
            offload_checkpoint(self.store, ck, self.state)
        except WorkOrderError:
            return
        self.store.drop_device_replica(ck)

    # -- checks --------------------------------------------------------------------------------------
    def planes(self) -> dict:
        return {n: np.asarray(x) for n, x in self.state.planes[MAIN].items()}

    def check_content(self, lost: dict) -> None:
        planes = self.planes()
        for h, tokens in self.model.items():
            if h in lost:
                intact = lost[h][MAIN]
                assert intact < len(tokens), (h, intact, len(tokens))
                assert content_ok(self.store, MAIN, h, tokens[:intact], planes), h
            else:
                assert content_ok(self.store, MAIN, h, tokens, planes), (h, "served without its content")


def history(s: Serving) -> dict:
    """The scripted serving history; returns its handles by name."""
    a = s.activate(100, 60, base=0)
    d = s.activate(70, 10, base=40)
    g = s.activate(64, 0, base=200)
    s.run_round({a: 100, d: 70, g: 64})  # round 0
    ck_a = s.finish(a, retain=True)
    ck_d = s.finish(d, retain=True)
    ck_g = s.finish(g, retain=True)
    s.offload_and_drop(ck_g)
    b = s.activate(100, 40, base=80, source=ck_a)  # fork: page 0 shared, COW of a 36-column tail
    s.offload_and_drop(ck_d)  # ck_d Host-only (unless the state is already poisoned)
    e = s.activate(70, 40, base=120, source=ck_d)  # restores ck_d's pages, COW of its tail
    s.run_round({b: 10, e: 5})  # round 1
    c = s.activate(20, 20, base=160)
    s.restore_dropping_host(ck_g)  # its pages now exist only in round 2's work
    s.run_round({b: 10, c: 20, e: 5})  # round 2
    s.finish(c, retain=False)
    ck_b = s.finish(b, retain=True)
    s.run_round({e: 10})  # round 3
    s.release(ck_a)  # ck_b's COW source page goes with it
    s.run_round({e: 10})  # round 4
    return {"e": e, "ck_b": ck_b, "ck_d": ck_d, "ck_g": ck_g}


def repair_and_check(s: Serving):
    store = s.store
    with pytest.raises(WorkOrderError, match="resync"):
        store.require_synced(s.state)
    s.state, report = resync(store, s.state)
    store.require_synced(s.state)
    store.audit_invariants()
    lost = {**report.lost_sequences, **report.lost_checkpoints}
    assert lost == store.lost()
    s.check_content(lost)
    return report, lost


def continue_serving(s: Serving, lost: dict) -> None:
    """Lost sequences are refused, then truncated back into service; everything then drains."""
    store = s.store
    for h, intact in lost.items():
        if isinstance(h, SequenceHandle):
            with pytest.raises(LostContentError, match="quarantined"):
                store.commit(h, len(s.model[h]))
            with pytest.raises(LostContentError):
                store.map([store.row(h)], [len(s.model[h]) + 1])
            with pytest.raises(LostContentError):
                store.finish(h, retain=True)
            assert (store.host_block_table()[store.row(h)] == SENTINEL_PAGE).all()
            if intact[MAIN] >= store.address_space(h).protected_frontier:
                store.truncate(h, intact[MAIN])
                s.model[h] = s.model[h][: intact[MAIN]]
            else:
                s.finish(h, retain=False)
        else:
            with pytest.raises(LostContentError):
                store.activate(len(s.model[h]), 1, source=h)
            s.release(h)
    assert store.lost() == {}
    live = [h for h in s.model if isinstance(h, SequenceHandle)]
    if live:
        s.at = -1
        s.run_round({h: 3 for h in live})
        s.state = apply_work_jit(s.state, store.take_work())
        store.require_synced(s.state)
        s.check_content({})
    for h in list(s.model):
        s.finish(h, retain=False) if isinstance(h, SequenceHandle) else s.release(h)
    s.state = apply_work_jit(s.state, store.take_work())
    store.audit_invariants()
    for kind in store.pool_kinds:
        assert store.pool(kind).allocated == 0 and store.pool(kind).reserved == 0
    assert store.host_occupancy().arena.extent_count == 0
    assert (np.asarray(s.state.tables[MAIN]) == SENTINEL_PAGE).all()


@pytest.mark.parametrize("slip", ["skip", "repeat", "reorder"])
@pytest.mark.parametrize("at", range(ROUNDS))
def test_resync_after_a_slip(slip, at):
    s = Serving(slip, at)
    names = history(s)
    report, lost = repair_and_check(s)
    assert report.applied <= at + 1 and report.serial == s.store.work_serial
    for name, h in names.items():
        if h not in s.model:
            continue
        if s.changed[h] < at:
            assert h not in lost, f"{name} was complete before the slip at round {at} but was reported lost"
        if name == "e" or (name == "ck_b" and at <= 2):
            assert h in lost, f"{name} committed after the slip at round {at} but was not reported"
    if at <= 1:  # ck_b's COW tail was missed and its source page is gone: nothing to replay it from
        assert names["ck_b"] in lost
    if at == 2 and slip != "repeat":  # ck_g's restore was missed and its Host replica released
        assert names["ck_g"] in lost
    continue_serving(s, lost)


def test_resync_of_a_healthy_state_changes_nothing():
    s = Serving()
    history(s)
    s.state = apply_work_jit(s.state, s.store.take_work())
    before = s.store.snapshot()
    state, report = resync(s.store, s.state)
    assert state is s.state and report.clean and report.lost == ()
    assert s.store.snapshot()["work_serial"] == before["work_serial"]


def test_resync_of_a_lagging_state():
    s = Serving()
    history(s)
    f = s.activate(10, 10, base=200)
    s.store.map(f, 10)
    s.store.take_work()  # taken, never applied: the state lags one work behind
    with pytest.raises(WorkOrderError, match="were never applied"):
        s.store.require_synced(s.state)
    s.state, report = resync(s.store, s.state)
    assert report.clean  # the missed work only mapped a page: nothing is lost
    s.store.require_synced(s.state)
    s.check_content({})
    continue_serving(s, {})


def test_a_blank_state_recovers_what_host_replicas_hold():
    """A state lost with a failed donated step: a blank replacement, then a resync; the checkpoint
    with Host replicas comes back from the arena, everything else is reported."""
    s = Serving()
    names = history(s)
    s.state = apply_work_jit(s.state, s.store.take_work())
    s.store.require_synced(s.state)
    s.state = allocate_state(s.store, fill=float("nan"))
    report, lost = repair_and_check(s)
    assert names["ck_d"] not in lost and report.replayed[MAIN][1] >= 2  # restored from the arena
    assert names["e"] in lost and names["ck_b"] in lost
    continue_serving(s, lost)


def test_resync_refuses_a_state_of_another_store():
    s = Serving()
    history(s)
    other = Serving()
    with pytest.raises(WorkOrderError, match=f"belongs to store {s.store.identity}, not to this store"):
        resync(other.store, s.state)
    assert other.store.work_serial == 0


def test_a_quarantined_row_is_refused_by_row_verbs_with_a_clear_error():
    s = Serving("skip", 1)
    names = history(s)
    s.state, report = resync(s.store, s.state)
    e = names["e"]
    row = s.store.row(e)
    for verb in (
        lambda: s.store.commit([row], [0]),
        lambda: s.store.trim([row]),
        lambda: s.store.settle([row], [len(s.model[e])]),
    ):
        with pytest.raises(LostContentError, match=f"row {row} holds a sequence whose content a resync found lost"):
            verb()
    with pytest.raises(LostContentError, match="above its intact"):
        s.store.truncate(e, report.lost_sequences[e][MAIN] + 1)
    assert not issubclass(LostContentError, RowError)
    assert isinstance(next(iter(report.lost)), (SequenceHandle, CheckpointHandle))
