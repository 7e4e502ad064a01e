"""HostRestore: the restore state machine of the Host tier (Host -> Device) and replica release.

A restore copies the Host replica's bytes into the pool's pending page writes, which the next round
work carries to the device (:func:`~ninfer_kv.apply_work` writes them before any unit reads the
pages); verify and publish follow at once in the store, so a restore completes within one call::

    begin (lease Device pages, pin) -> copy (stage the writes) -> verify -> publish (set the lease)
                                                                         \\-> cancel (all undone)

It runs for :meth:`HostRestore.checkpoint` (Device pages from the available pages) and, inside an
activation, for :meth:`HostRestore.for_activation` (Device pages from the row's reservation, with
an exact undo).  The same object drops Device replicas (placement Both -> Host-only) and releases
Host replicas (Both -> Device-only).  Every page and pool change is a transition of the pool
runtime (:meth:`~ninfer_kv.store.runtime.PoolRuntime.begin_restore` and its successors).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ..schema.errors import InvariantError, LifecycleError, PoolCapacityError
from ..host import TransferReport
from ..host.page_id_runs import coalesce_runs
from ..schema.kinds import PoolKind
from .transfer_records import Fault, HostTransferReport, PoolTransfer, pick_pages, pick_pools
from .runtime import PoolRuntime
from .summary import HostTransferStats

__all__ = ["HostRestore"]


def _on_device(rt: PoolRuntime, slots: np.ndarray) -> np.ndarray:
    return rt.pages.device_page[slots] >= 0


def _hosted(rt: PoolRuntime, slots: np.ndarray) -> np.ndarray:
    return rt.pages.host_page[slots] >= 0


class HostRestore:
    """Host -> Device restores of Host-only pages, Device replica drop and Host replica release.

    A restore of one pool's pages moves ``begun -> published`` or ``begun -> cancelled`` within
    one call; an activation's restore may later be undone (``published -> undone``) by the undo
    :meth:`for_activation` returns, while the activation fails.

    Invariants:

    * only Host-only pages are restored, each with a valid Host replica; a restored page keeps its
      Host replica (placement Both);
    * while the copy runs, the pages are pinned and the destination Device pages are leased but
      not published; a failure before publication drops the staged page writes and the pins and
      gives the leases back (the store unchanged);
    * a published restore sets each page's Device lease and records its fill as a Host restore of
      the next round work (so a resync can replay it), then unpins;
    * a Device replica is dropped only from a page with a valid Host replica, no pin and no active
      reference (pages of active sequences stay on Device);
    * a Host replica is never released while it is a page's only copy (unless the same call
      restores the page first) nor while the page is pinned.

    Args:
      runtimes: the store's ``{PoolKind: PoolRuntime}`` (with their Host replica tables attached).
      stats: the tier's counters (``restored_*``, ``dropped_device_pages``, ``released_host_pages``).
      fault: the store's fault injector, called before each of :data:`RESTORE_STAGES`.
    """

    def __init__(self, runtimes: Mapping[PoolKind, PoolRuntime], stats: HostTransferStats, fault: Fault):
        self.rts = runtimes
        self.stats = stats
        self.fault = fault

    # -- restore ------------------------------------------------------------------------------------------------
    def _host_only(self, kind: PoolKind, space: int, verb: str, blocks: int | None = None) -> PoolTransfer | None:
        """The transfer of the Host-only pages of ``space``'s first ``blocks`` pages (``None``: all)."""
        rt = self.rts[kind]
        picked = pick_pages(kind, rt, space, verb, lambda slots: ~_on_device(rt, slots), blocks)
        if picked is None:
            return None
        job = PoolTransfer.of(kind, rt, *picked)
        if not rt.pages.host_valid(job.slots, job.columns).all():
            raise InvariantError(f"pool {kind.value}: a Host-only page has no valid Host replica")
        return job

    def _copy_and_verify(self, jobs: list[PoolTransfer]) -> None:
        """Stage every job's Host replicas as page writes onto its Device pages, then verify them."""
        for job in jobs:
            self.fault("restore_copy", job.kind)
            job.report = self._copy_in(job)
        for job in jobs:
            self.fault("restore_verify", job.kind)
            job.verify(restore=True)

    @staticmethod
    def _copy_in(job: PoolTransfer) -> TransferReport:
        """Host -> Device: stage the pages' Host replicas, in logical order, as pending writes to
        the job's Device pages (the next round work carries them; the extent may go at once)."""
        s, ids = job.slots, job.targets.ids
        job.rt.stage_host_restores(s, ids)
        runs = int(coalesce_runs(np.asarray(ids, np.int64))[0].size) if s.size else 0
        return TransferReport(pages=int(s.size), runs=runs, chunks=runs, bytes=int(s.size) * job.stride, path="work")

    def _publish(self, job: PoolTransfer) -> None:
        job.rt.publish_restore(job.slots, job.targets)
        self.stats.restored_pages += job.report.pages
        self.stats.restored_bytes += job.report.bytes

    def checkpoint(self, spaces: Mapping[PoolKind, int], *, drop_host: bool = False) -> HostTransferReport:
        """Host -> Device for every Host-only page of checkpoint ``spaces = {PoolKind: inactive space
        slot}`` (placement -> Both, or Device with ``drop_host``).  Device pages come from each
        pool's available pages."""
        jobs = [job for kind, space in spaces.items()
                if (job := self._host_only(kind, space, "restore_checkpoint")) is not None]
        if drop_host:
            self._check_release_host(spaces, restoring=True)
        for job in jobs:
            pool = job.rt.pool
            if job.slots.size > pool.available:
                raise PoolCapacityError(
                    f"pool {job.kind.value}: restoring {job.slots.size} Host-only pages needs as many available "
                    f"Device pages; only {pool.available} of {pool.capacity} are available ({pool.allocated} "
                    f"allocated, {pool.reserved} reserved); nothing was changed"
                )
        if jobs:
            self.fault("restore_reserve", None)
            begun: list[PoolTransfer] = []
            try:
                for job in jobs:
                    job.targets = job.rt.begin_restore(job.slots)
                    begun.append(job)
                self._copy_and_verify(jobs)
                self.fault("restore_publish", None)
            except BaseException:
                for job in reversed(begun):
                    job.rt.cancel_restore(job.slots, job.targets)
                raise
            for job in jobs:
                self._publish(job)
        report = HostTransferReport.combine("restore", {j.kind: j.report for j in jobs})
        if drop_host:
            self.release_host(spaces)
        return report

    def for_activation(self, kind: PoolKind, space: int, row: int, blocks: int | None = None) -> Callable[[], None]:
        """Activation stage ``restore_host`` for one pool: restore the Host-only pages among the
        source's first ``blocks`` logical blocks (``None``: all of them; an activation from a prefix
        reads no page beyond it) into Device pages materialized from ``row``'s reservation (which the
        ``reserve`` stage enlarged by their count).  Returns the exact undo: Device pages back to the
        reservation, Host replicas untouched, counters restored."""
        job = self._host_only(kind, space, "activation restore", blocks)
        if job is None:
            return lambda: None
        rt = job.rt
        job.targets = rt.begin_restore(job.slots, row)
        try:
            self._copy_and_verify([job])
        except BaseException:
            rt.cancel_restore(job.slots, job.targets)
            raise
        self._publish(job)
        stats = self.stats

        def undo():
            rt.undo_restore(job.slots, job.targets)
            stats.restored_pages -= job.report.pages
            stats.restored_bytes -= job.report.bytes

        return undo

    # -- Device replica drop ------------------------------------------------------------------------------------
    def drop_device(self, spaces: Mapping[PoolKind, int]) -> int:
        """Release the Device leases of a checkpoint's pages (placement Both -> Host-only).

        Refused (nothing changed) when a page with a Device lease has no valid Host replica, is
        pinned, or is referenced by an active address space.  Returns the leases released.
        """
        plans = []
        for kind, rt, slots, on in pick_pools(self.rts, spaces, "drop_device_replica", _on_device):
            pg = rt.pages
            active = np.flatnonzero(on & (pg.active_refs[slots] > 0))
            if active.size:
                raise LifecycleError(
                    f"pool {kind.value}: cannot drop the Device replica of logical blocks {active.tolist()}: an "
                    f"active address space reads them (pages of active sequences stay on Device)"
                )
            missing = np.flatnonzero(on & ~rt.host_replica_valid(slots))
            if missing.size:
                raise LifecycleError(
                    f"pool {kind.value}: cannot drop the Device replica of logical blocks {missing.tolist()}: they "
                    f"have no valid Host replica (offload_checkpoint first)"
                )
            plans.append((rt, slots[on]))
        released = 0
        for rt, sel in plans:
            rt.drop_device_replicas(sel)
            released += int(sel.size)
        self.stats.dropped_device_pages += released
        return released

    # -- Host replica release -----------------------------------------------------------------------------------
    def _check_release_host(self, spaces: Mapping[PoolKind, int], *, restoring: bool = False
                            ) -> list[tuple[PoolRuntime, np.ndarray]]:
        plans = []
        for kind, rt, slots, hosted in pick_pools(self.rts, spaces, "release_host_replica", _hosted):
            only = np.flatnonzero(hosted & (rt.pages.device_page[slots] < 0))
            if only.size and not restoring:
                raise LifecycleError(
                    f"pool {kind.value}: cannot release the Host replica of logical blocks {only.tolist()}: it is "
                    f"their only copy (restore_checkpoint first)"
                )
            plans.append((rt, slots[hosted]))
        return plans

    def release_host(self, spaces: Mapping[PoolKind, int]) -> int:
        """Release the Host replicas of a checkpoint's pages (placement Both -> Device-only).

        Refused (nothing changed) when a page is Host-only or pinned.  Pages shared with other
        checkpoints lose their Host replica too (it is the page's).  Returns the replicas released.
        """
        released = 0
        for rt, sel in self._check_release_host(spaces):
            rt.release_host_replicas(sel)
            released += int(sel.size)
        self.stats.released_host_pages += released
        return released
