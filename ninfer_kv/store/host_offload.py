"""HostOffload: the offload state machine of the Host tier (Device -> Host) and its OffloadPlan handle.

The store holds no device array, so an offload is split in three around the caller's gather::

    plan (reserve extents, pin pages) -> [caller: gather_pages] -> complete (copy, verify, publish)
                                                                 \\-> cancel (free extents, unpin)

:meth:`HostOffload.plan` reserves the destination extents and pins the pages; the caller gathers
the pages' payload from its :class:`~ninfer_kv.KVDeviceState` with the jittable
:func:`~ninfer_kv.device.work.gather_pages` (or :meth:`HostOffload.gather_in_place` for host-addressable
planes); :meth:`HostOffload.complete` copies the payload into the extents, verifies epoch and
coverage and publishes the Host replicas through the pool runtime
(:meth:`~ninfer_kv.store.runtime.PoolRuntime.publish_offload`).  Pins hold across the split, so
nothing can release, trim or rewrite the pages in between.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from ..schema.errors import (
    HostCapacityError,
    InvariantError,
    LifecycleError,
    PayloadError,
    StaleHandleError,
    WorkOrderError,
)
from ..host import ExtentAllocationError, HostKVArena, StaleExtentError, TransferReport
from ..host.block_copy import copy_blocks
from ..host.page_id_runs import coalesce_runs
from ..schema.kinds import PoolKind
from ..schema.layout import word_dtype
from ..schema.round_work import POISONED, GatherRequest, OffloadPayload
from ..schema.buckets import bucket, ladder
from .transfer_records import Fault, HostTransferReport, PoolTransfer, pick_pools
from .runtime import PoolRuntime
from .summary import HostTransferStats

__all__ = ["HostOffload", "OffloadPlan"]


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` is exactly the memory of ``b`` (same start, shape, strides and item size)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype.itemsize == b.dtype.itemsize)


@dataclasses.dataclass(eq=False)
class OffloadPlan:
    """A planned offload: extents reserved, pages pinned, waiting for its payload.

    ``pages``: ``{PoolKind: int32 (B,)}`` the Device pages to gather (logical order, padded to a
    power-of-two bucket with page 0); ``request``: the argument of :func:`~ninfer_kv.device.work.gather_pages`
    (those pages plus the plan's identity, so the payload names the plan it was gathered for);
    ``min_serial``: the work serial the gathering state must have reached; ``token``: the plan's
    number in its store; ``store``: the store's identity; ``status``: ``"planned"``,
    ``"completed"`` or ``"cancelled"``.
    """

    owner: "HostOffload"
    jobs: list[PoolTransfer]
    pages: dict
    min_serial: int
    token: int = 0
    store: int = 0
    status: str = "planned"

    @property
    def page_counts(self) -> dict:
        """``{PoolKind: pages to copy}`` (without the bucket padding)."""
        return {j.kind: int(j.slots.size) for j in self.jobs}

    @property
    def request(self) -> GatherRequest:
        """What :func:`~ninfer_kv.device.work.gather_pages` gathers: the pages and the plan's identity
        (fresh arrays)."""
        return GatherRequest(pages={k: v.copy() for k, v in self.pages.items()},
                             store=np.asarray(self.store, np.int32), token=np.asarray(self.token, np.int32))

    def __repr__(self) -> str:
        return f"OffloadPlan(token={self.token}, store={self.store}, pages={self.page_counts}, status={self.status!r})"


class HostOffload:
    """The offload state machine of one store's Host tier: plans in flight, their extents and pins.

    Each :class:`OffloadPlan` moves ``planned -> completed`` (:meth:`complete`) or ``planned ->
    cancelled`` (:meth:`cancel`, :meth:`cancel_all`, or any failure of :meth:`complete` after its
    payload was accepted); a completed or cancelled plan is refused by every verb.

    Invariants (:meth:`audit_invariants`):

    * ``in_flight`` holds exactly the planned plans, by token; tokens are never reused;
    * a planned plan holds, per pool with pages to copy, one live extent of the arena that no
      pool's :class:`~ninfer_kv.store.pool_host_replicas.PoolHostReplicas` counts, and one pin on
      each of its pages, which stay live; between verbs these are the only pins of any page;
    * a plan's pages had a Device replica and no valid Host replica when planned; a Host replica is
      published only after :meth:`PoolTransfer.verify` found the page's generation, epoch,
      committed columns and Device lease unchanged, so every published replica is valid;
    * nothing is published before the payload is copied and verified: a failure frees the plan's
      extents and unpins its pages (the store as before :meth:`plan`).

    Args:
      arena: the tier's :class:`HostKVArena` (extents are reserved in it at :meth:`plan`).
      runtimes: the store's ``{PoolKind: PoolRuntime}`` (with their Host replica tables attached).
      stats: the tier's counters (``offloaded_pages``/``offloaded_bytes``).
      fault: the store's fault injector, called before each of :data:`OFFLOAD_STAGES`.
      identity: the store's identity, carried by every plan and checked on its payload.
    """

    def __init__(self, arena: HostKVArena, runtimes: Mapping[PoolKind, PoolRuntime], stats: HostTransferStats,
                 fault: Fault, identity: int = 0):
        self.arena = arena
        self.rts = runtimes
        self.stats = stats
        self.fault = fault
        self.identity = int(identity)
        self._plans = 0  # offload plans made so far (their tokens)
        self.in_flight: dict[int, OffloadPlan] = {}  # planned, neither completed nor cancelled

    # -- planned ------------------------------------------------------------------------------------------
    def plan(self, spaces: Mapping[PoolKind, int], serial_of: Callable[[PoolKind, np.ndarray], int]) -> OffloadPlan:
        """Reserve the destination extents and pin the pages of an offload of checkpoint ``spaces =
        {PoolKind: inactive space slot}`` (placement -> Both after :meth:`complete`).

        One extent per pool, for that pool's pages without a valid Host replica, in logical order;
        the allocation recipe of every pool is validated as a whole before anything is allocated.
        ``serial_of(kind, ids)`` is the work serial a state must have reached to hold the pages'
        current content.
        """
        jobs = []
        for kind, rt, slots, todo in pick_pools(self.rts, spaces, "offload", lambda rt, s: ~rt.host_replica_valid(s)):
            if (rt.pages.device_page[slots[todo]] < 0).any():
                raise InvariantError(f"pool {kind.value}: a page has neither a Device nor a valid Host replica")
            jobs.append(PoolTransfer.of(kind, rt, slots, todo))
        if not jobs:
            return self._new_plan([], {}, 0)
        recipe = [("allocate", j.rt.host_replicas.layout.extent_bytes(j.slots.size), j.rt.host_replicas.tag)
                  for j in jobs]
        self.fault("offload_reserve", None)
        try:
            self.arena.validate_plan(recipe)
        except ExtentAllocationError as exc:
            need = ", ".join(f"{j.kind.value}: {j.slots.size} pages = {n} B" for j, (_, n, _) in zip(jobs, recipe))
            raise HostCapacityError(
                f"offload needs Host extents ({need}) that the arena cannot place: {exc}; nothing was changed"
            ) from exc
        extents = self.arena.execute_plan(recipe)
        pages = {}
        min_serial = 0
        for job, extent in zip(jobs, extents):
            job.extent = extent
            job.ids, job.id_gens = job.rt.begin_offload(job.slots)
            b = bucket(job.slots.size, ladder(1, 2, job.rt.pool.capacity))
            ids = np.zeros(b, np.int32)
            ids[: job.slots.size] = job.ids
            pages[job.kind] = ids
            min_serial = max(min_serial, serial_of(job.kind, job.ids))
        return self._new_plan(jobs, pages, min_serial)

    def _new_plan(self, jobs: list[PoolTransfer], pages: dict, min_serial: int) -> OffloadPlan:
        self._plans += 1
        plan = OffloadPlan(self, jobs, pages, min_serial, token=self._plans, store=self.identity)
        self.in_flight[plan.token] = plan
        return plan

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, OffloadPlan):
            raise TypeError(f"expected an OffloadPlan, got {type(plan).__name__}")
        if plan.owner is not self:
            raise StaleHandleError(
                f"offload plan {plan.token} belongs to store {plan.store}, not to this store ({self.identity})")
        if plan.status != "planned":
            raise LifecycleError(f"the offload plan is already {plan.status}")

    @staticmethod
    def _check_payload(plan: OffloadPlan, payload) -> None:
        """Refuse (nothing changed, the plan stays in flight) a payload gathered for another plan."""
        if not isinstance(payload, OffloadPayload):
            raise TypeError(
                f"the offload payload must be an OffloadPayload (what gather_pages(state, plan.request) or "
                f"ninfer_kv.device.offload_gather.gather_offload(store, plan, state) returns: it names the plan it was gathered for), got "
                f"{type(payload).__name__}"
            )
        store, token = int(np.asarray(payload.store)), int(np.asarray(payload.token))
        if (store, token) != (plan.store, plan.token):
            raise PayloadError(
                f"the payload was gathered for offload plan {token} of store {store}; this is plan {plan.token} of "
                f"store {plan.store}: nothing was published and the plan is still in flight"
            )
        if set(payload.pages) != set(plan.pages) or any(
                not np.array_equal(np.asarray(payload.pages[k]), ids) for k, ids in plan.pages.items()):
            got = {k.value: np.asarray(v).tolist() for k, v in payload.pages.items()}
            want = {k.value: v.tolist() for k, v in plan.pages.items()}
            raise PayloadError(
                f"the payload holds pages {got}; offload plan {plan.token} needs pages {want}: nothing was published "
                f"and the plan is still in flight"
            )

    def gather_in_place(self, plan: OffloadPlan, planes_of: Callable[[PoolKind], Mapping],
                        serial: int) -> OffloadPayload:
        """The payload of ``plan`` read straight from host-addressable planes into the plan's own
        extents (one copy; a CPU device's planes are host memory): ``planes_of(kind)`` gives the
        pool's planes as arrays numpy reads in place, ``serial`` the state's applied-work serial.

        The payload's planes are the extents' pages, so :meth:`complete` finds them in place and
        only verifies and publishes.  Writing the extents now is harmless whatever follows: they
        are this plan's until it completes or is cancelled.
        """
        self._check_plan(plan)
        planes = {}
        for job in plan.jobs:
            layout = job.rt.host_replicas.layout
            views = layout.page_planes(self.arena.view(job.extent))
            axis = layout.layout.order.page_axis
            source = {name: np.asarray(x) for name, x in planes_of(job.kind).items()}
            for name, view in views.items():  # one gather of the plan's pages (logical order), as bytes
                copy_blocks(view[: job.ids.size], np.moveaxis(source[name], axis, 0), job.ids)
            planes[job.kind] = views
        request = plan.request
        return OffloadPayload(request.store, request.token, np.asarray(serial, np.int32), request.pages, planes)

    # -- planned -> cancelled -------------------------------------------------------------------------------
    def _release_plan(self, plan: OffloadPlan) -> None:
        for job in plan.jobs:
            job.rt.unpin(job.slots)
            self.arena.free(job.extent)
        plan.status = "cancelled"
        self.in_flight.pop(plan.token, None)

    def cancel(self, plan: OffloadPlan) -> None:
        """Abandon a planned offload: free its extents and unpin its pages (full rollback)."""
        self._check_plan(plan)
        self._release_plan(plan)

    def cancel_all(self) -> int:
        """Cancel every plan in flight (a resync: a payload gathered before it proves nothing);
        returns how many."""
        plans = list(self.in_flight.values())
        for plan in plans:
            self._release_plan(plan)
        return len(plans)

    # -- planned -> completed -------------------------------------------------------------------------------
    def complete(self, plan: OffloadPlan, payload) -> HostTransferReport:
        """Copy the gathered payload into the plan's extents, verify epoch and coverage, publish.

        ``payload`` is the :class:`OffloadPayload` :func:`~ninfer_kv.device.work.gather_pages` returned for
        ``plan.request``: it names its plan, its pages and the serial of the state it came from.  A
        payload of another plan (or of other pages) is refused with :class:`PayloadError`, nothing
        published and the plan still in flight.  Any later failure (a state that missed a work, a
        page that changed, an injected fault) rolls the plan back: nothing is published, the
        extents are freed and the pages unpinned.
        """
        self._check_plan(plan)
        self._check_payload(plan, payload)
        try:
            serial, planes = payload.serial, payload.planes
            got = int(np.asarray(serial))
            if got == POISONED or got < plan.min_serial:
                raise WorkOrderError(
                    f"the offload payload was gathered from a state at work serial {got}; the pages' content "
                    f"needs serial >= {plan.min_serial} (apply every round work before gathering)"
                )
            for job in plan.jobs:
                self.fault("offload_copy", job.kind)
                job.report = self._copy_out(job, planes[job.kind])
            for job in plan.jobs:
                self.fault("offload_verify", job.kind)
                job.verify(restore=False)
            self.fault("offload_publish", None)
        except BaseException:
            self._release_plan(plan)
            raise
        for job in plan.jobs:  # publish (infallible); the new replicas replace stale ones
            job.rt.publish_offload(job.slots, job.extent, job.epochs, job.columns)
        plan.status = "completed"
        self.in_flight.pop(plan.token, None)
        report = HostTransferReport.combine("offload", {j.kind: j.report for j in plan.jobs})
        self.stats.offloaded_pages += report.pages
        self.stats.offloaded_bytes += report.bytes
        return report

    def _copy_out(self, job: PoolTransfer, planes: Mapping) -> TransferReport:
        """Device -> Host: the gathered pages (logical order) into the job's extent."""
        n = int(job.slots.size)
        views = job.rt.host_replicas.layout.page_planes(self.arena.view(job.extent))
        in_place = True
        for name, view in views.items():
            words = np.asarray(planes[name])
            if words.shape[0] < n or words.shape[1:] != view.shape[1:]:
                raise ValueError(
                    f"pool {job.kind.value}: payload plane {name!r} has shape {words.shape}; the plan needs "
                    f"({n}+, {', '.join(map(str, view.shape[1:]))})"
                )
            if _same_memory(words[:n], view):  # gathered in place (gather_in_place): nothing to copy
                continue
            in_place = False
            view.view(word_dtype(view.dtype))[:n] = words[:n].view(word_dtype(view.dtype))
        runs = int(coalesce_runs(np.asarray(job.ids, np.int64))[0].size)
        return TransferReport(pages=n, runs=runs, chunks=1 if not in_place else runs, bytes=n * job.stride,
                              path="in place" if in_place else "gather")

    # -- checks ---------------------------------------------------------------------------------------------------
    def reserved_extents(self) -> int:
        """Extents the plans in flight hold (not yet any pool's)."""
        return sum(len(p.jobs) for p in self.in_flight.values())

    def audit_invariants(self) -> None:
        """Raise :class:`InvariantError` unless the plans in flight hold live pages and live extents,
        and their pins are every pin of every pool."""
        pins = {kind: np.zeros(rt.pages.capacity, np.int64) for kind, rt in self.rts.items()}
        for plan in self.in_flight.values():
            for job in plan.jobs:
                if not job.rt.pages.live[job.slots].all():
                    raise InvariantError(f"offload plan {plan.token}: a page it copies is not live")
                np.add.at(pins[job.kind], job.slots, 1)
                try:
                    self.arena.check(job.extent)
                except StaleExtentError as exc:
                    raise InvariantError(f"offload plan {plan.token}: {exc}") from None
        for kind, rt in self.rts.items():  # between verbs, the only pins are those of plans in flight
            if not np.array_equal(rt.pages.pins, pins[kind]):
                bad = int(np.flatnonzero(rt.pages.pins != pins[kind])[0])
                raise InvariantError(
                    f"pool {kind.value}: page slot {bad} holds {int(rt.pages.pins[bad])} pins, offload plans in flight "
                    f"account for {int(pins[kind][bad])}"
                )
