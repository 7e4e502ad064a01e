"""Round works and device states: the verbs that hand work to the device and check what it applied.

``take_work`` (every pool's part of the next :class:`~ninfer_kv.schema.round_work.RoundWork`), ``pending_work``,
``require_synced`` / ``sync_problem`` and ``plan_resync`` (the store's half of
:func:`~ninfer_kv.resync`).  A state is read only through its sync record
(``state.sync_status()``); the device layer (:mod:`ninfer_kv.device`) builds and changes states.
"""

from __future__ import annotations


import numpy as np

from ..schema.errors import WorkOrderError
from ..schema.kinds import PoolKind
from ..schema.round_work import BLANK, PendingWork, RoundWork, SyncStatus
from .core import StoreCore
from .page_writes import PageWrites
from .repair import ResyncReport, dated_epoch

__all__ = ["WorkVerbs"]


def _works(n: int) -> str:
    return f"{n} round work" + ("" if n == 1 else "s")


class WorkVerbs:
    """Round-work and device-state verbs of :class:`~ninfer_kv.store.KVStore`."""

    _core: StoreCore

    def take_work(self) -> RoundWork:
        """Everything the device must do before the next unit reads, since the last take.

        Per pool: the block-table entries written since (``int32 (3, U)``), the partial-tail COW
        copies (``int32 (3, K)``) and the Host restores (``int32 (2, R)`` plus the payload), in
        bucketed shapes.  Apply it with :func:`~ninfer_kv.apply_work` (inside the caller's step, or
        :func:`~ninfer_kv.device.work.apply_work_jit`) before the next unit; works apply in order, none skipped.
        """
        pools = {kind: rt.take_work() for kind, rt in self._core.runtimes.items()}
        work = RoundWork(
            serial=np.asarray(self._core.work_serial, np.int32),
            pools=pools,
            store=np.asarray(self._core.identity, np.int32),
        )
        self._core.work_serial += 1
        return work

    def pending_work(self) -> dict[PoolKind, PendingWork]:
        """What the next :meth:`take_work` will hold, per pool: :class:`PendingWork` ``(tables,
        copies, restores)`` — distinct block-table entries, COW copies and Host restores, the entries
        that carry work (``RoundWork.counts()`` gives the bucketed buffer sizes a take pads them to,
        ``PoolWork.used()`` the entries of a taken work that carry work)."""
        return {k: rt.pending_work() for k, rt in self._core.runtimes.items()}

    def require_synced(self, state) -> None:
        """Raise :class:`WorkOrderError` unless ``state`` applied exactly the works taken so far, in
        order (reads the state's serial: waits for the state).  The message says what happened and
        how to repair it (:func:`~ninfer_kv.resync`)."""
        if not hasattr(state, "sync_status"):
            raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
        problem = self.sync_problem(state.sync_status())
        if problem is not None:
            raise WorkOrderError(problem)

    def sync_problem(self, status: SyncStatus) -> str | None:
        """What is wrong with a state at ``status`` (``None``: it applied every work in order)."""
        taken = self._core.work_serial
        fix = "; repair it with `state, report = ninfer_kv.resync(store, state)`"
        if status.owner not in (0, self._core.identity):
            return (
                f"the device state belongs to store {status.owner}, not to this store ({self._core.identity}): use the "
                f"state this store allocated"
            )
        if status.poisoned:
            if status.offending == BLANK:
                return (
                    f"the device state is blank: it was allocated after {_works(taken)} were taken and holds "
                    f"none of their content" + fix
                )
            if status.offending_store not in (None, 0, self._core.identity):
                return (
                    f"the device state is poisoned: it applied {_works(status.applied)} in order, then was "
                    f"given work {status.offending} of store {status.offending_store}, another store (this one is "
                    f"{self._core.identity}); since then every op over it is dropped" + fix
                )
            how = "skipped" if status.offending > status.applied else "repeated or reordered"
            return (
                f"the device state is poisoned: it applied {_works(status.applied)} in order, then was given "
                f"work {status.offending} (a work was {how}); since then every op over it is dropped" + fix
            )
        if status.applied > taken:
            return (
                f"the device state applied {_works(status.applied)} but this store handed out only {taken}: "
                f"it belongs to another store"
            )
        if status.applied < taken:
            return (
                f"the device state applied {_works(status.applied)}; the store handed out {taken} (works "
                f"{status.applied}..{taken - 1} were never applied)" + fix
            )
        return None

    def plan_resync(self, status: SyncStatus) -> tuple[RoundWork | None, ResyncReport]:
        """The store's half of :func:`~ninfer_kv.resync` for a state at ``status``: the work that brings it
        in line (every block table republished, missed page writes replayed; its serial is the
        store's current one, and the state must be reset to it before applying) and the report.
        Content no source can restore (neither the state, nor a Host replica, nor a replayed copy)
        is quarantined (see :mod:`~ninfer_kv.store.repair`).  Page writes pending before the repair
        ride the take after it.  Returns ``(None, report)`` when the state is already in line."""
        taken = self._core.work_serial
        problem = self.sync_problem(status)
        if problem is None:
            return None, ResyncReport(applied=status.applied, serial=taken)
        if status.owner not in (0, self._core.identity) or status.applied > taken:
            raise WorkOrderError(
                problem
                if status.owner not in (0, self._core.identity)
                else (
                    f"the device state applied {status.applied} round works but this store handed out only {taken}: it "
                    f"belongs to another store"
                )
            )
        epoch, applied = dated_epoch(status), max(0, min(status.applied, taken))
        cancelled = self._core.host.offload.cancel_all() if self._core.host is not None else 0
        replays = {kind: PageWrites(rt.layout, rt.pool.capacity) for kind, rt in self._core.runtimes.items()}
        lost = {kind: rt.plan_resync(epoch, applied, replays[kind]) for kind, rt in self._core.runtimes.items()}
        lost_sequences, lost_checkpoints = {}, {}
        quarantined: list[int] = []  # rows of sequences whose content is lost
        for kind_name, handles, found in (
            ("sequence", self._core.sequences(), lost_sequences),
            ("checkpoint", self._core.checkpoints(), lost_checkpoints),
        ):
            for h in handles:
                rec = self._core.registry.get(h)
                if not any(rec.slots[k] in lost[k] for k in self._core.runtimes) and rec.lost is None:
                    continue
                intact = {}
                for k, rt in self._core.runtimes.items():
                    slot = rec.slots[k]
                    now = int(rt.spaces.committed[slot])
                    intact[k] = min(lost[k].get(slot, now), (rec.lost or {}).get(k, now))
                rec.lost = intact
                found[h] = dict(intact)
                if kind_name == "sequence":
                    self._core.rows.set_quarantined(rec.row, True)
                    quarantined.append(rec.row)
        replayed = {k: w.counts() for k, w in replays.items()}
        pools = {kind: rt.take_repair_work(replays[kind], quarantined) for kind, rt in self._core.runtimes.items()}
        work = RoundWork(
            serial=np.asarray(taken, np.int32), pools=pools, store=np.asarray(self._core.identity, np.int32)
        )
        self._core.work_serial += 1
        report = ResyncReport(
            applied=status.applied,
            serial=self._core.work_serial,
            lost_sequences=lost_sequences,
            lost_checkpoints=lost_checkpoints,
            replayed=replayed,
            cancelled_offloads=cancelled,
        )
        return work, report
