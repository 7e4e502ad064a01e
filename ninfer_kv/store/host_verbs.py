"""Host tier verbs of the store: offload (plan -> gather -> complete, or cancel), Device replica
drop, restore, Host replica release.  The protocol itself is :mod:`ninfer_kv.store.host_replicas`."""

from __future__ import annotations

import dataclasses

from .bundle import CheckpointHandle
from ..errors import LifecycleError
from .host_replicas import HostTier, HostTransferReport, OffloadPlan
from .summary import HostOccupancy
from .core import StoreCore

__all__ = ["HostVerbs"]


def _host_addressable(state) -> bool:
    """Whether every plane of ``state`` is one array on one CPU device (numpy reads it in place)."""
    for planes in state.planes.values():
        for x in planes.values():
            devices = getattr(x, "devices", None)
            if devices is None:
                return False
            found = devices()
            if len(found) != 1 or next(iter(found)).platform != "cpu":
                return False
    return True


class HostVerbs:
    """Host replica verbs of :class:`~ninfer_kv.store.KVStore`."""

    def __init__(self, core: StoreCore):
        self.core = core

    def _tier(self, verb: str) -> HostTier:
        if self.core.host is None:
            raise LifecycleError(f"{verb} needs a Host tier; build the store with host_arena= or host_bytes=")
        return self.core.host

    @property
    def host_arena(self):
        """The :class:`~ninfer_kv.host.HostKVArena` of the Host tier, or ``None``."""
        return None if self.core.host is None else self.core.host.arena

    def plan_offload(self, handle: CheckpointHandle) -> OffloadPlan:
        """Plan the Device -> Host copy of every page of a retained checkpoint, in every pool, that
        has no valid Host replica yet: reserve one destination extent per pool (the whole recipe of
        every pool is proven by ``arena.validate_plan`` first) and pin the pages.

        Then gather the payload from a state that applied every round work taken so far (and the
        next one when ``plan.min_serial`` says so) with :func:`~ninfer_kv.gather_pages` (jittable;
        ``plan.pages`` is its argument) and finish with :meth:`complete_offload`, or give the plan
        up with :meth:`cancel_offload`.  While planned, the pages are pinned: releasing the
        checkpoint, dropping or releasing its replicas is refused.

        Raises :class:`HostCapacityError` (a :class:`PoolCapacityError`) when the arena cannot place
        the extents and :class:`LifecycleError` when a page is pinned by another copy; the store is
        then unchanged.
        """
        rec = self.core.checkpoint_record(handle, "plan_offload")
        return self._tier("plan_offload").plan_offload(rec.slots, self.core.serial_of)

    def gather_offload(self, plan: OffloadPlan, state):
        """The :class:`~ninfer_kv.work.OffloadPayload` of ``plan`` gathered from ``state``.

        Where the state's planes are host memory (one CPU device) the pages are copied straight
        from them into the plan's extents, once (:meth:`HostTier.gather_in_place`); elsewhere a
        jitted :func:`~ninfer_kv.gather_pages` of ``plan.request`` gathers them on the device and
        the Device -> Host copy starts through the arena's staging memory."""
        from ..device.work import gather_pages_jit

        tier = self._tier("gather_offload")
        if _host_addressable(state):
            return tier.gather_in_place(plan, lambda kind: state.planes[kind], state.host_serial())
        payload = gather_pages_jit(state, plan.request)
        planes = {k: {n: tier.arena.start_to_host(x) for n, x in p.items()} for k, p in payload.planes.items()}
        return dataclasses.replace(payload, planes=planes)

    def complete_offload(self, plan: OffloadPlan, payload) -> HostTransferReport:
        """Copy -> verify epoch and committed coverage -> publish the Host replicas of a planned
        offload (placement ``device`` -> ``both``; the Device replicas stay, see
        :meth:`drop_device_replica`).

        ``payload`` is ``gather_pages(state, plan.request)`` (or :meth:`gather_offload`): an
        :class:`~ninfer_kv.work.OffloadPayload` naming the plan, its pages and the serial
        of the state it came from.  Raises :class:`PayloadError` (nothing published, the plan still in
        flight) for a payload gathered for another plan or other pages, ``TypeError`` for anything
        else than a payload; :class:`StaleReplicaError` when a page changed since the plan and
        :class:`WorkOrderError` when the state had not applied the works the pages need — then the
        plan is rolled back (extents freed, pages unpinned) and nothing is published.  Returns a
        :class:`HostTransferReport`.
        """
        return self._tier("complete_offload").complete_offload(plan, payload)

    def cancel_offload(self, plan: OffloadPlan) -> None:
        """Abandon a planned offload: free its extents and unpin its pages (full rollback)."""
        self._tier("cancel_offload").cancel_offload(plan)

    def offload_checkpoint(self, handle: CheckpointHandle, state) -> HostTransferReport:
        """:meth:`plan_offload`, :meth:`gather_offload` from ``state`` and :meth:`complete_offload`
        in one call (the state must have applied every round work taken so far; when a pending
        work touches the pages, take and apply it first)."""
        plan = self.plan_offload(handle)
        try:
            payload = self.gather_offload(plan, state)
        except BaseException:
            self.cancel_offload(plan)
            raise
        return self.complete_offload(plan, payload)

    def drop_device_replica(self, handle: CheckpointHandle) -> int:
        """Release the Device leases of a checkpoint whose pages all have a valid Host replica
        (placement ``both`` -> ``host``); returns the leases released.

        Rule: a page read by an active address space stays on Device; a page shared only among
        inactive checkpoints may become Host-only (a later activation of any of them restores it).
        Refused (:class:`LifecycleError`, nothing changed) when a page with a Device replica has no
        valid Host replica, is pinned, or is referenced by an active address space.
        """
        rec = self.core.checkpoint_record(handle, "drop_device_replica")
        return self._tier("drop_device_replica").drop_device(rec.slots)

    def restore_checkpoint(self, handle: CheckpointHandle, *, drop_host: bool = False) -> HostTransferReport:
        """Host -> Device copy of the checkpoint's Host-only pages (placement ``host`` -> ``both``).

        Per pool: reserve Device pages from the available pages -> copy (into the pending round work:
        the device writes the pages in the next :func:`~ninfer_kv.apply_work`) -> verify -> publish
        the Device leases.  The Host replicas stay unless ``drop_host=True`` (then every Host replica of the
        checkpoint is released afterwards: placement ``device``).  Raises
        :class:`PoolCapacityError` (nothing changed) when a pool lacks available pages.
        """
        rec = self.core.checkpoint_record(handle, "restore_checkpoint")
        return self._tier("restore_checkpoint").restore(rec.slots, drop_host=bool(drop_host))

    def release_host_replica(self, handle: CheckpointHandle) -> int:
        """Release the Host replicas of a checkpoint's pages (placement ``both`` -> ``device``); an
        extent is freed with its last page.  Refused (nothing changed) when a page is Host-only (its
        Host replica is its only copy) or pinned.  Returns the replicas released."""
        rec = self.core.checkpoint_record(handle, "release_host_replica")
        return self._tier("release_host_replica").release_host(rec.slots)

    def host_occupancy(self) -> HostOccupancy | None:
        """The Host arena's occupancy, per-pool Host pages and the transfer counters (``None`` without
        a Host tier)."""
        return None if self.core.host is None else self.core.host.occupancy()

    def host_counters(self) -> dict:
        """The Host transfer counters as a dict (``offloaded_pages``, ``restored_pages``, ...)."""
        return self.core.stats.to_json()

