"""Host tier verbs of the store: offload (plan -> gather -> complete, or cancel), Device replica
drop, restore, Host replica release.  The protocol itself is :mod:`ninfer_kv.store.host_tier`."""

from __future__ import annotations

from .bundle import CheckpointHandle
from ..schema.errors import LifecycleError
from .host_offload import OffloadPlan
from .host_tier import HostTier
from .transfer_records import HostTransferReport
from .summary import HostOccupancy
from .core import StoreCore

__all__ = ["HostVerbs"]


class HostVerbs:
    """Host replica verbs of :class:`~ninfer_kv.store.KVStore`."""

    _core: StoreCore

    def _tier(self, verb: str) -> HostTier:
        if self._core.host is None:
            raise LifecycleError(f"{verb} needs a Host tier; build the store with host_arena= or host_bytes=")
        return self._core.host

    @property
    def host_arena(self):
        """The :class:`~ninfer_kv.host.HostKVArena` of the Host tier, or ``None``."""
        return None if self._core.host is None else self._core.host.arena

    def plan_offload(self, handle: CheckpointHandle) -> OffloadPlan:
        """Plan the Device -> Host copy of every page of a retained checkpoint, in every pool, that
        has no valid Host replica yet: reserve one destination extent per pool (the whole recipe of
        every pool is proven by ``arena.validate_plan`` first) and pin the pages.

        Then gather the payload from a state that applied every round work taken so far (and the
        next one when ``plan.min_serial`` says so) with :func:`~ninfer_kv.device.work.gather_pages` (jittable;
        ``plan.pages`` is its argument) and finish with :meth:`complete_offload`, or give the plan
        up with :meth:`cancel_offload`.  While planned, the pages are pinned: releasing the
        checkpoint, dropping or releasing its replicas is refused.

        Raises :class:`HostCapacityError` (a :class:`PoolCapacityError`) when the arena cannot place
        the extents and :class:`LifecycleError` when a page is pinned by another copy; the store is
        then unchanged.
        """
        rec = self._core.checkpoint_record(handle, "plan_offload")
        return self._tier("plan_offload").offload.plan(rec.slots, self._core.serial_of)

    def gather_offload_from_host(self, plan: OffloadPlan, planes, serial: int):
        """The :class:`~ninfer_kv.schema.round_work.OffloadPayload` of ``plan`` copied straight from host-addressable
        planes (``{PoolKind: {plane name: array}}``, read in place by numpy) into the plan's extents,
        once; ``serial`` is the applied-work serial of the state they belong to.  The device layer's
        :func:`~ninfer_kv.device.offload_gather.gather_offload` calls it for a state on one CPU device."""
        return self._tier("gather_offload_from_host").offload.gather_in_place(plan, lambda kind: planes[kind], serial)

    def complete_offload(self, plan: OffloadPlan, payload) -> HostTransferReport:
        """Copy -> verify epoch and committed coverage -> publish the Host replicas of a planned
        offload (placement ``device`` -> ``both``; the Device replicas stay, see
        :meth:`drop_device_replica`).

        ``payload`` is ``gather_pages(state, plan.request)`` (or :func:`~ninfer_kv.device.offload_gather.gather_offload`): an
        :class:`~ninfer_kv.schema.round_work.OffloadPayload` naming the plan, its pages and the serial
        of the state it came from.  Raises :class:`PayloadError` (nothing published, the plan still in
        flight) for a payload gathered for another plan or other pages, ``TypeError`` for anything
        else than a payload; :class:`StaleReplicaError` when a page changed since the plan and
        :class:`WorkOrderError` when the state had not applied the works the pages need — then the
        plan is rolled back (extents freed, pages unpinned) and nothing is published.  Returns a
        :class:`HostTransferReport`.
        """
        return self._tier("complete_offload").offload.complete(plan, payload)

    def cancel_offload(self, plan: OffloadPlan) -> None:
        """Abandon a planned offload: free its extents and unpin its pages (full rollback)."""
        self._tier("cancel_offload").offload.cancel(plan)

    def drop_device_replica(self, handle: CheckpointHandle) -> int:
        """Release the Device leases of a checkpoint whose pages all have a valid Host replica
        (placement ``both`` -> ``host``); returns the leases released.

        Rule: a page read by an active address space stays on Device; a page shared only among
        inactive checkpoints may become Host-only (a later activation of any of them restores it).
        Refused (:class:`LifecycleError`, nothing changed) when a page with a Device replica has no
        valid Host replica, is pinned, or is referenced by an active address space.
        """
        rec = self._core.checkpoint_record(handle, "drop_device_replica")
        return self._tier("drop_device_replica").restore.drop_device(rec.slots)

    def restore_checkpoint(self, handle: CheckpointHandle, *, drop_host: bool = False) -> HostTransferReport:
        """Host -> Device copy of the checkpoint's Host-only pages (placement ``host`` -> ``both``).

        Per pool: reserve Device pages from the available pages -> copy (into the pending round work:
        the device writes the pages in the next :func:`~ninfer_kv.apply_work`) -> verify -> publish
        the Device leases.  The Host replicas stay unless ``drop_host=True`` (then every Host replica of the
        checkpoint is released afterwards: placement ``device``).  Raises
        :class:`PoolCapacityError` (nothing changed) when a pool lacks available pages.
        """
        rec = self._core.checkpoint_record(handle, "restore_checkpoint")
        return self._tier("restore_checkpoint").restore.checkpoint(rec.slots, drop_host=bool(drop_host))

    def release_host_replica(self, handle: CheckpointHandle) -> int:
        """Release the Host replicas of a checkpoint's pages (placement ``both`` -> ``device``); an
        extent is freed with its last page.  Refused (nothing changed) when a page is Host-only (its
        Host replica is its only copy) or pinned.  Returns the replicas released."""
        rec = self._core.checkpoint_record(handle, "release_host_replica")
        return self._tier("release_host_replica").restore.release_host(rec.slots)

    def host_occupancy(self) -> HostOccupancy | None:
        """The Host arena's occupancy, per-pool Host pages and the transfer counters (``None`` without
        a Host tier)."""
        return None if self._core.host is None else self._core.host.occupancy()

    def host_counters(self) -> dict:
        """The Host transfer counters as a dict (``offloaded_pages``, ``restored_pages``, ...)."""
        return self._core.stats.to_json()

