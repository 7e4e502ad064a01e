"""resync reports lost only what no source can restore: Host replicas and COW replays count as recovered.

Two device states follow one store: a reference that applies every round work, and a state that
falls out of line — it *lags* (stops applying works), is *poisoned* (skips one, then gets the next)
or is *blank* (a fresh state allocated after the works, as after a failed donated step).  Writes go
through each state's own block tables, as a kernel's would, so a state that missed a mapping drops
them.  One history per (backend, placement, state kind), over every pool of the store — Main and
MTP (``mtp``), Main and Draft Full (``dflash``, head-major planes):

* ``live``: an active sequence, 40 tokens before the slip, 30 after (truly lost beyond 40; all of it
  for a blank state);
* ``old``: a checkpoint committed before the slip, ``new`` and ``base`` after it; each placed on the
  device only, on the Host only (offloaded, Device replica dropped) or on both;
* ``fork``: a fork of ``base`` (a restore for a Host-only ``base``, a COW of its partial tail),
  activated after the slip and appending nothing.

After :func:`ninfer_kv.resync` the report must name exactly what no source holds, the state must be
in line, every handle must hold its committed tokens (its intact frontier when reported) in the
repaired state as in the reference, and a fork of every intact checkpoint (a restore from the Host
for a Host-only one) must hold the same bytes in both states.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.schema.geometry import SENTINEL_PAGE
from ninfer_kv.device import apply_work_jit, resync
from ninfer_kv.store import KVStore, SequenceHandle

from .helpers import P, WRITE_PAD, _write_cells, content_ok, read_cells, tiny_plan
from ninfer_kv.device import allocate_state, offload_checkpoint

NAN = float("nan")


class Pair:
    """A store, a reference state that applies every work, and a state under test (``dut``)."""

    def __init__(self, backend: str, kind: str = "lagging"):
        self.store = KVStore(
            tiny_plan(backend, layers=1, head_dim=8, pages=20, max_concurrency=6, max_context=256), host_bytes=1 << 20
        )
        self.kind = kind
        self.ref = allocate_state(self.store)
        self.dut = allocate_state(self.store, fill=NAN)
        self.follow = True  # the state under test applies the works taken
        self.tokens: dict = {}  # handle -> committed tokens (every pool)
        self.base: dict = {}
        store = self.store
        pages = max(store.pool(k).capacity for k in store.pool_kinds)
        self.pad = (store.max_concurrency * store.logical_pages, pages, pages)
        self.report = None
        self._appends: list = []  # (handle, start, tokens) the next step writes

    # -- the caller's verbs ---------------------------------------------------------------------------
    def values(self, h, kind, start: int, n: int) -> np.ndarray:
        """Token values exact in bf16, distinct per handle, pool and position."""
        k = list(self.store.pool_kinds).index(kind)
        return np.asarray([1 + (self.base[h] + 31 * k + t) % 250 for t in range(start, start + n)], np.float32)

    def activate(self, prompt: int, budget: int, base: int, source=None) -> SequenceHandle:
        h = self.store.activate(prompt, budget, source=source)
        self.tokens[h] = self.tokens[source] if source is not None else 0
        self.base[h] = self.base[source] if source is not None else base
        return h

    def take(self, *, dut: bool | None = None) -> None:
        work = self.store.take_work().pad_to(*self.pad)
        self.ref = apply_work_jit(self.ref, work)
        if self.follow if dut is None else dut:
            self.dut = apply_work_jit(self.dut, work)

    def append(self, h, n: int) -> None:
        """The next :meth:`step` appends ``n`` tokens to ``h`` in every pool."""
        store, start = self.store, self.tokens[h]
        for kind in store.pool_kinds:
            store.map(h, start + n, pool=kind)
        self._appends.append((h, start, n))

    def step(self) -> None:
        """Take the work, write every pending append through the block tables of each state that
        follows, commit."""
        self.take()
        store = self.store
        for h, start, n in self._appends:
            row = store.row(h)
            for kind in store.pool_kinds:
                vals = self.values(h, kind, start, n)
                self.ref = _write(self.ref, store, kind, row, start, vals)
                if self.follow:  # no step runs over a state left behind (its stale tables would misdirect it)
                    self.dut = _write(self.dut, store, kind, row, start, vals)
                store.commit(h, start + n, pool=kind)
            self.tokens[h] = start + n
        self._appends = []

    def finish(self, h):
        ck = self.store.finish(h, retain=True)
        self.tokens[ck], self.base[ck] = self.tokens.pop(h), self.base.pop(h)
        return ck

    def place(self, ck, placement: str) -> None:
        if placement != "device":
            offload_checkpoint(self.store, ck, self.ref)
        if placement == "host":
            self.store.drop_device_replica(ck)

    def repair(self, monkeypatch) -> None:
        """``resync`` the state under test; the same repair work is applied to the reference."""
        store, plan = self.store, self.store.plan_resync
        captured = []

        def spy(status):
            work, report = plan(status)
            captured.append(work)
            return work, report

        monkeypatch.setattr(store, "plan_resync", spy)
        self.dut, self.report = resync(store, self.dut)
        monkeypatch.undo()
        self.ref = apply_work_jit(self.ref, captured[0])
        store.require_synced(self.dut)
        store.require_synced(self.ref)
        store.audit_invariants()
        self.follow = True

    # -- checks ---------------------------------------------------------------------------------------
    def lost(self) -> dict:
        return {**self.report.lost_sequences, **self.report.lost_checkpoints}

    def check_content(self) -> None:
        """Every handle holds its committed tokens (its intact frontier when reported) in the state
        under test as in the reference; an active sequence's pages are gathered through each state's
        own block table."""
        store, lost = self.store, self.store.lost()
        for kind in store.pool_kinds:
            dut = {n: np.asarray(x) for n, x in self.dut.pool_planes(kind).items()}
            ref = {n: np.asarray(x) for n, x in self.ref.pool_planes(kind).items()}
            axis = store.layout(kind).order.page_axis
            for h, n in self.tokens.items():
                n = lost[h][kind] if h in lost else n
                expected = list(self.values(h, kind, 0, n))
                assert content_ok(store, kind, h, expected, ref), (h, kind, "reference")
                assert content_ok(store, kind, h, expected, dut), (h, kind, n)
                if isinstance(h, SequenceHandle) and h not in lost and n:
                    row = store.row(h)
                    pages = np.asarray(self.dut.table(kind))[row]
                    assert np.array_equal(pages, np.asarray(self.ref.table(kind))[row])
                    pos = np.arange(n)
                    got = read_cells(dut, axis, pages[pos // P], pos % P)
                    want = read_cells(ref, axis, pages[pos // P], pos % P)
                    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), (h, kind)


def _write(state, store, kind, row: int, start: int, values: np.ndarray):
    """Write ``values`` at positions ``start..`` of ``row`` through ``state``'s block table (a sentinel
    entry drops the token, as a kernel's append does)."""
    table = np.asarray(state.table(kind))
    pos = start + np.arange(values.size)
    pages = table[row, pos // P].astype(np.int32)
    assert values.size <= WRITE_PAD
    pg = np.full(WRITE_PAD, SENTINEL_PAGE, np.int32)
    cl = np.zeros(WRITE_PAD, np.int32)
    vl = np.zeros(WRITE_PAD, np.float32)
    pg[: values.size], cl[: values.size], vl[: values.size] = pages, pos % P, values
    planes = _write_cells(dict(state.pool_planes(kind)), pg, cl, vl, page_axis=store.layout(kind).order.page_axis)
    return state.replace_planes(kind, planes)


def _written(s: Pair, n: int, base: int) -> SequenceHandle:
    """A root sequence with ``n`` tokens written and committed in every pool (one step)."""
    h = s.activate(n, 0, base=base)
    s.append(h, n)
    s.step()
    return h


def history(s: Pair, placement: str) -> dict:
    """The scripted history (see the module docstring); the slip falls between rounds 0 and 1."""
    live = s.activate(40, 40, base=0)
    old = s.activate(100, 0, base=50)
    s.append(live, 40)
    s.append(old, 100)
    s.step()  # round 0: work 0, committed in epoch 1
    ck_old = s.finish(old)
    s.place(ck_old, placement)
    if s.kind in ("lagging", "poisoned"):
        s.follow = False  # the slip: work 1 never reaches the state
    new = s.activate(100, 0, base=100)
    base = s.activate(100, 0, base=150)
    s.append(new, 100)
    s.append(base, 100)
    s.append(live, 30)
    s.step()  # round 1: work 1, committed in epoch 2
    ck_new, ck_base = s.finish(new), s.finish(base)
    s.place(ck_new, placement)
    s.place(ck_base, placement)
    fork = s.activate(100, 10, base=0, source=ck_base)  # restores (Host-only base) and copies its 36-column tail
    s.take(dut=s.kind == "poisoned")  # work 2: out of order for the poisoned state
    if s.kind == "blank":
        s.dut = allocate_state(s.store, fill=NAN)
    return {"live": live, "ck_old": ck_old, "ck_new": ck_new, "ck_base": ck_base, "fork": fork}


def expected_lost(kind: str, placement: str) -> dict:
    """What no source can restore: ``{name: intact frontier}`` (the same in every pool)."""
    blank = kind == "blank"
    lost = {"live": 0 if blank else 40}  # its 30 last tokens (all 70 when blank) exist nowhere else
    if placement == "device":  # no Host replica: content the state never got is gone
        lost.update(ck_new=0, ck_base=0, fork=0)
        if blank:
            lost["ck_old"] = 0
    return lost


@pytest.mark.parametrize("placement", ["device", "host", "both"])
@pytest.mark.parametrize("kind", ["blank", "lagging", "poisoned"])
@pytest.mark.parametrize("backend", ["mtp", "dflash"])
def test_resync_loses_only_what_no_source_holds(backend, kind, placement, monkeypatch):
    s = Pair(backend, kind)
    names = history(s, placement)
    s.repair(monkeypatch)
    pools = s.store.pool_kinds
    assert s.lost() == {names[n]: dict.fromkeys(pools, f) for n, f in expected_lost(kind, placement).items()}
    s.check_content()
    # every intact checkpoint serves a fork (a Host-only one restores from the Host) in both states alike
    forks = [s.activate(100, 0, base=0, source=ck) for ck in list(s.tokens) if not isinstance(ck, SequenceHandle)
             and ck not in s.lost()]
    if placement == "host":
        assert len(forks) == 3
    s.take()
    s.store.require_synced(s.dut)
    s.check_content()


def test_pending_writes_left_by_a_repair_ride_the_next_work(monkeypatch):
    """A repair taken while an activation's restores are pending leaves them to the next work: a
    state that then skips that work must have them replayed by the next repair."""
    s = Pair("dflash")
    ck = s.finish(_written(s, 100, base=7))
    s.place(ck, "host")
    s.follow = False
    s.take()  # never applied: the state lags
    s.activate(100, 10, source=ck, base=0)  # its restores and COW wait for the next take
    s.repair(monkeypatch)
    assert s.report.clean
    s.take(dut=False)  # the work carrying them: skipped
    s.take()  # the next one: the state is poisoned
    s.repair(monkeypatch)
    assert s.report.clean and all(r >= 2 for _, r in s.report.replayed.values())
    s.check_content()


@pytest.mark.parametrize("source", ["host-only", "restore-pending"])
def test_a_missed_copy_replays_from_its_source_host_replica(source, monkeypatch):
    """A fork's COW was missed and its one-page source is no longer readable on the device (Host-only,
    or awaiting a restore in a later work): the copy is replayed from the source's Host replica."""
    s = Pair("mtp")
    ck = s.finish(_written(s, 40, base=11))
    s.place(ck, "both")
    s.follow = False
    s.activate(40, 10, source=ck, base=0)  # the copy rides a work the state misses
    s.take()
    s.store.drop_device_replica(ck)  # the source page is Host-only now
    if source == "restore-pending":
        s.append(s.activate(60, 0, base=3), 60)  # takes the Device page the source left
        s.activate(40, 10, source=ck, base=0)  # restores the source onto another Device page: pending
    s.repair(monkeypatch)
    assert s.report.clean
    s.step()
    s.check_content()


@pytest.mark.parametrize("kind, placement", [("lagging", "device"), ("blank", "device"), ("blank", "both")])
def test_pending_copies_are_rated_by_what_they_read(kind, placement, monkeypatch):
    """A repair taken while a chain of COWs is pending (a fork of a fork's checkpoint, both copies
    recorded since the last take, the second reading the first one's source): the next work performs
    them after the repair, so they hold what the repair leaves in the page they read."""
    s = Pair("dflash", kind)
    ck1 = s.finish(_written(s, 40, base=21))
    s.place(ck1, placement)
    s.follow = kind != "lagging"
    s.take()  # a work the lagging state misses
    f1 = s.activate(40, 10, source=ck1, base=0)
    ck2 = s.finish(f1)
    f2 = s.activate(40, 10, source=ck2, base=0)
    if kind == "blank":
        s.dut = allocate_state(s.store, fill=NAN)
    s.repair(monkeypatch)
    gone = kind == "blank" and placement == "device"  # ck1's page exists nowhere else
    assert s.lost() == ({h: dict.fromkeys(s.store.pool_kinds, 0) for h in (ck1, ck2, f2)} if gone else {})
    s.take()
    s.check_content()
