"""Host replica tier of the KV store: Host extent membership and the replica publication protocol.

One :class:`~ninfer_kv.host.HostKVArena` serves every pool of a store; each pool packs its pages
with its own :class:`~ninfer_kv.host.HostKVPageLayout` (its own stride) and tags its extents with
its name.  A page's Host replica is a *membership*: page ``i`` of one extent, plus the
``(epoch, coverage)`` verified when it was published.  Several pages share an extent (one extent
per pool per offload, pages in the checkpoint's logical order); :class:`PoolHostReplicas` counts
the pages still holding a replica in each extent and frees the extent with the last one.

A replica is valid for ``n`` columns iff ``replica.epoch == page.epoch and replica.coverage >= n``;
only valid replicas are ever published, copied from, or counted in a placement.

Placement of a page: *Device-only* (a Device lease, no valid Host replica), *Host-only* (a valid
Host replica, no Device lease) or *Both*.  The rules the tier keeps:

* a page referenced by an active address space always has a Device replica (activation restores
  Host-only pages first); a page shared only among inactive checkpoints may be Host-only;
* a page with a writer has no Host replica (a Move that makes a page writable drops it), so a Host
  replica can never go stale in normal operation; the verify step still checks it;
* a Host-only page always has a valid Host replica: its only copy is never released.

Every transfer follows the contract's publication order, per page and pool::

    reserve destination -> copy -> verify epoch and coverage -> publish replica -> release source

The store holds no device array, so the device side of a transfer belongs to the caller's state:

* an offload is split in three: :meth:`HostTier.plan_offload` reserves the destination extents
  and pins the pages; the caller gathers the pages' payload from its
  :class:`~ninfer_kv.KVDeviceState` with the jittable :func:`~ninfer_kv.gather_pages` (Device ->
  Host); :meth:`HostTier.complete_offload` copies the payload into the extents, verifies epoch and
  coverage and publishes.  :meth:`HostTier.cancel_offload` abandons a plan with full rollback.
  Pins hold across the split, so nothing can release or rewrite the pages in between;
* a restore copies the Host replica's bytes into the pool's pending page writes, which the next
  round work carries to the device (:func:`~ninfer_kv.apply_work` writes them before any unit
  reads the pages); verify and publish follow at once on the host.

with the source and destination pinned during the copy (the logical pages carry a transaction pin,
so releasing the checkpoint, dropping or releasing a replica of a pinned page is refused) and the
destination invisible until published.  An offload reserves all its extents at once, after
:meth:`HostKVArena.validate_plan` proved the whole allocation recipe fits; any failure before
publication (a verify failure, an injected fault) frees them and unpins, so nothing is published.

The store's ``fault_injector(stage, pool)`` is called before each stage of a transfer:
:data:`OFFLOAD_STAGES` and :data:`RESTORE_STAGES` (``*_reserve`` and ``*_publish`` store-wide with
pool ``None``, ``*_copy`` and ``*_verify`` per pool).  ``*_verify`` runs after the copy and before
publication: the copy's pins are held there.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from ..host import ExtentAllocationError, HostExtent, HostKVArena, StaleExtentError, TransferReport, host_layout_of
from ..host.block_copy import copy_blocks
from ..host.runs import coalesce_runs
from ..kinds import PoolKind
from ..errors import (
    HostCapacityError,
    InvariantError,
    LifecycleError,
    PayloadError,
    PoolCapacityError,
    StaleHandleError,
    StaleReplicaError,
    WorkOrderError,
)
from ..layout import word_dtype
from ..work import POISONED, GatherRequest, OffloadPayload
from .buckets import bucket, ladder
from .summary import HostOccupancy, HostPoolOccupancy, HostTransferStats

__all__ = [
    "OFFLOAD_STAGES",
    "RESTORE_STAGES",
    "HostTier",
    "PoolHostReplicas",
    "HostTransferReport",
    "OffloadPlan",
    "placement_of",
]

OFFLOAD_STAGES: tuple[str, ...] = ("offload_reserve", "offload_copy", "offload_verify", "offload_publish")
"""Fault-injection points of an offload, in order (``reserve``/``publish`` store-wide, pool ``None``)."""

RESTORE_STAGES: tuple[str, ...] = ("restore_reserve", "restore_copy", "restore_verify", "restore_publish")
"""Fault-injection points of a restore.  Inside activation (stage ``restore_host``) only ``restore_copy``
and ``restore_verify`` are called, per pool: the reservation is the activation's own."""


# -- reports and summaries ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostTransferReport:
    """What one offload or restore of a checkpoint moved, over every pool.

    ``pages``/``bytes``: payload copied; ``runs``: transfer runs (adjacent physical IDs coalesced);
    ``chunks``: copies issued; ``pools``: the per-pool :class:`~ninfer_kv.host.TransferReport`
    (pools with nothing to move are absent).
    """

    direction: str
    pages: int
    bytes: int
    runs: int
    chunks: int
    pools: Mapping[str, TransferReport]

    @staticmethod
    def combine(direction: str, pools: Mapping[str, TransferReport]) -> "HostTransferReport":
        return HostTransferReport(
            direction=direction,
            pages=sum(r.pages for r in pools.values()),
            bytes=sum(r.bytes for r in pools.values()),
            runs=sum(r.runs for r in pools.values()),
            chunks=sum(r.chunks for r in pools.values()),
            pools=dict(pools),
        )


def placement_of(device: np.ndarray, host_valid: np.ndarray) -> tuple[str, dict]:
    """Placement of a set of pages from per-page ``device`` (has a lease) and ``host_valid`` flags.

    Returns ``(placement, {"device": n, "host": n, "both": n})`` with the per-page counts
    (Device-only, Host-only, Both).  ``placement`` is

    * ``"device"`` when some page has no valid Host replica (an offload has work to do) — this
      includes a checkpoint mixing Device-only and Host-only pages — or when there are no pages;
    * ``"host"`` when every page has a valid Host replica and some page has no Device replica (an
      activation will restore it);
    * ``"both"`` when every page has both.
    """
    both = int((device & host_valid).sum())
    dev_only = int((device & ~host_valid).sum())
    host_only = int((~device).sum())
    counts = {"device": dev_only, "host": host_only, "both": both}
    if dev_only or device.size == 0:
        return "device", counts
    return ("host" if host_only else "both"), counts


# -- per-pool bookkeeping -------------------------------------------------------------------------------------


class PoolHostReplicas:
    """Host extent memberships of one pool's logical pages.

    The replica fields live in the pool's :class:`~ninfer_kv.store.logical_page.LogicalPageTable`
    (``host_extent``, ``host_page``, ``host_epoch``, ``host_coverage``); this object keeps, per live
    extent, how many pages still hold a replica in it, and frees the extent when that reaches 0.

    Invariant: ``users[e]`` equals the number of live pages whose ``host_extent`` is ``e``; every
    key is a live extent of the arena tagged with this pool; no two pages share ``(extent, page)``.
    """

    def __init__(self, runtime, arena: HostKVArena):
        self.rt = runtime
        self.arena = arena
        self.layout = host_layout_of(runtime.layout)
        self.tag = runtime.kind.value
        self.users: dict[HostExtent, int] = {}

    def valid(self, slots: np.ndarray) -> np.ndarray:
        """Per page: a Host replica valid for the page's committed columns."""
        return self.rt.pages.host_valid(slots, self.rt.page_committed(slots))

    def attach(self, slots: np.ndarray, extent: HostExtent, epochs: np.ndarray, coverages: np.ndarray) -> None:
        """Publish pages ``0..len(slots)-1`` of ``extent`` as the Host replicas of ``slots`` (infallible)."""
        self.rt.publish_host_replicas(slots, extent, epochs, coverages)
        self.users[extent] = self.users.get(extent, 0) + int(slots.size)

    def detach(self, slots: np.ndarray) -> None:
        """Drop the Host replicas of ``slots``; an extent whose last page goes is freed (infallible)."""
        users = self.users
        for extent in self.rt.clear_host_replicas(slots):
            left = users[extent] - 1
            if left:
                users[extent] = left
            else:
                del users[extent]
                self.arena.free(extent)

    def stage_restores(self, slots: np.ndarray, dst_ids: np.ndarray, writes) -> None:
        """Record, in ``writes`` (a :class:`~ninfer_kv.store.page_writes.PageWrites`), the Host replica
        of each page ``slots[i]`` as a whole-page write onto Device page ``dst_ids[i]`` (logical order;
        the payload is copied once, into the next work's payload, so the extent may go at once)."""
        pg = self.rt.pages
        slots = np.asarray(slots, np.int64)
        dst_ids = np.asarray(dst_ids, np.int64)
        extents = [pg.host_extent[x] for x in slots.tolist()]  # handles (an object column: a list)
        pages = pg.host_page[slots].astype(np.int64)
        for extent in dict.fromkeys(extents):  # one vectorized copy per extent, in order
            at = np.array([i for i, e in enumerate(extents) if e is extent], np.int64)
            views = self.layout.page_planes(self.arena.view(extent))
            index = pages[at]
            contiguous = bool(index.size) and np.array_equal(index, np.arange(index[0], index[0] + index.size))
            if contiguous:
                writes.restore(dst_ids[at], {n: v[index[0] : index[0] + index.size] for n, v in views.items()})
            else:
                writes.restore(dst_ids[at], views, index)

    def occupancy(self) -> HostPoolOccupancy:
        pg = self.rt.pages
        live = pg.live
        extent_pages = sum(self.layout.pages_in(e.nbytes) for e in self.users)
        return HostPoolOccupancy(
            pool=self.tag,
            stride=self.layout.stride,
            host_pages=int((live & (pg.host_page >= 0)).sum()),
            host_only_pages=int((live & (pg.device_page < 0)).sum()),
            extents=len(self.users),
            extent_pages=extent_pages,
            used_bytes=sum(e.nbytes for e in self.users),
        )

    def check_invariants(self) -> None:
        pg = self.rt.pages
        name = self.tag
        hosted = np.flatnonzero(pg.host_page >= 0)
        counts: dict[HostExtent, int] = {}
        seen: set = set()
        for s in hosted.tolist():
            extent = pg.host_extent[s]
            if extent is None or extent not in self.users:
                raise InvariantError(f"pool {name}: page slot {s} names an extent the pool does not hold")
            if extent.tag != self.tag:
                raise InvariantError(f"pool {name}: page slot {s} uses an extent tagged {extent.tag!r}")
            index = int(pg.host_page[s])
            if not 0 <= index < self.layout.pages_in(extent.nbytes):
                raise InvariantError(f"pool {name}: page slot {s} has Host page {index} outside its extent")
            if (extent, index) in seen:
                raise InvariantError(f"pool {name}: two pages share Host page {index} of one extent")
            seen.add((extent, index))
            counts[extent] = counts.get(extent, 0) + 1
        if counts != self.users:
            raise InvariantError(f"pool {name}: extent user counts disagree with the pages' Host replicas")
        if len(pg.host_extent) - pg.host_extent.count(None) != hosted.size:  # the hosted ones are not None
            raise InvariantError(f"pool {name}: a page without a Host replica names an extent")
        for extent in self.users:
            try:
                self.arena.check(extent)
            except StaleExtentError as exc:
                raise InvariantError(f"pool {name}: {exc}") from None

    def snapshot(self) -> list:
        return sorted(((e.offset, e.nbytes, e.tag), n) for e, n in self.users.items())


# -- the protocol -------------------------------------------------------------------------------------------------


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` is exactly the memory of ``b`` (same start, shape, strides and item size)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype.itemsize == b.dtype.itemsize)


@dataclasses.dataclass(eq=False)
class _Job:
    """One pool's part of a transfer: the pages, what the copy must preserve, what it produced."""

    kind: PoolKind
    rt: object
    table: PoolHostReplicas
    slots: np.ndarray  # logical pages to copy, in logical order
    blocks: np.ndarray  # their logical blocks in the checkpoint (for messages)
    columns: np.ndarray  # committed columns at reservation time
    epochs: np.ndarray
    generations: np.ndarray
    ids: np.ndarray = None  # Device page IDs (offload: sources; restore: destinations)
    id_gens: np.ndarray = None
    extent: HostExtent | None = None
    report: TransferReport | None = None


@dataclasses.dataclass(eq=False)
class OffloadPlan:
    """A planned offload: extents reserved, pages pinned, waiting for its payload.

    ``pages``: ``{PoolKind: int32 (B,)}`` the Device pages to gather (logical order, padded to a
    power-of-two bucket with page 0); ``request``: the argument of :func:`~ninfer_kv.gather_pages`
    (those pages plus the plan's identity, so the payload names the plan it was gathered for);
    ``min_serial``: the work serial the gathering state must have reached; ``token``: the plan's
    number in its store; ``store``: the store's identity; ``status``: ``"planned"``,
    ``"completed"`` or ``"cancelled"``.
    """

    tier: "HostTier"
    jobs: list
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
        """What :func:`~ninfer_kv.gather_pages` gathers: the pages and the plan's identity (fresh arrays)."""
        return GatherRequest(pages={k: v.copy() for k, v in self.pages.items()},
                             store=np.asarray(self.store, np.int32), token=np.asarray(self.token, np.int32))

    def __repr__(self) -> str:
        return f"OffloadPlan(token={self.token}, store={self.store}, pages={self.page_counts}, status={self.status!r})"


class HostTier:
    """The Host replica tier of one store: the arena, per-pool memberships and the transfer verbs.

    Args:
      arena: an empty :class:`HostKVArena` (the tier allocates and frees every extent in it).
      runtimes: the store's ``{PoolKind: PoolRuntime}``; each gets its :class:`PoolHostReplicas`.
      fault: ``fault(stage, pool_or_None)``, called before each transfer stage (the store's
        fault injector).
      identity: the store's identity, carried by every offload plan and checked on its payload.

    Every verb takes ``spaces = {PoolKind: inactive space slot}`` of one checkpoint, validates
    everything before it changes anything, and raises a clear error with the store unchanged.
    """

    def __init__(self, arena: HostKVArena, runtimes: Mapping, fault: Callable[[str, PoolKind | None], None],
                 identity: int = 0):
        if not isinstance(arena, HostKVArena):
            raise TypeError(f"host_arena must be a HostKVArena, got {type(arena).__name__}")
        if arena.occupancy().extent_count:
            raise ValueError(
                f"host_arena holds {arena.occupancy().extent_count} live extents; the store owns every extent of "
                f"its arena, so it must start empty"
            )
        self.arena = arena
        self.rts = dict(runtimes)
        self.fault = fault
        self.tables = {kind: PoolHostReplicas(rt, arena) for kind, rt in self.rts.items()}
        for kind, rt in self.rts.items():
            rt.host = self.tables[kind]
        self.stats = HostTransferStats()
        self.identity = int(identity)
        self._plans = 0  # offload plans made so far (their tokens)
        self.in_flight: dict[int, OffloadPlan] = {}  # planned, neither completed nor cancelled

    # -- helpers ---------------------------------------------------------------------------------------------
    def _pages(self, kind: PoolKind, space: int) -> np.ndarray:
        return self.rts[kind].spaces.pages_of(space).copy()

    @staticmethod
    def _refuse_pinned(kind: PoolKind, pins: np.ndarray, verb: str) -> None:
        pinned = np.flatnonzero(pins != 0)
        if pinned.size:
            raise LifecycleError(
                f"pool {kind.value}: {verb} refused: logical blocks {pinned.tolist()} are pinned by an in-flight copy"
            )

    def _job(self, kind: PoolKind, slots: np.ndarray, mask: np.ndarray) -> _Job:
        rt = self.rts[kind]
        pg = rt.pages
        sel = slots[mask]
        return _Job(
            kind=kind,
            rt=rt,
            table=self.tables[kind],
            slots=sel,
            blocks=np.flatnonzero(mask),
            columns=rt.page_committed(sel),
            epochs=pg.epoch[sel].copy(),
            generations=pg.generation[sel].copy(),
        )

    @staticmethod
    def _verify(job: _Job, *, restore: bool) -> None:
        """The copy's pages still hold the content they held at reservation, and the source is intact."""
        rt, s = job.rt, job.slots
        pg = rt.pages
        same = pg.live[s] & (pg.generation[s] == job.generations) & (pg.writer[s] < 0)
        epoch_now = pg.epoch[s]
        cols_now = rt.page_committed(s)
        same &= (epoch_now == job.epochs) & (cols_now == job.columns)
        if restore:  # the Host source is still a valid replica, the page still has no Device replica
            same &= pg.host_valid(s, job.columns) & (pg.device_page[s] < 0)
        else:  # the Device source is the same lease
            same &= (pg.device_page[s] == job.ids) & (pg.device_gen[s] == job.id_gens)
        if not same.all():
            i = int(np.flatnonzero(~same)[0])
            raise StaleReplicaError(
                f"pool {job.kind.value}: logical block {int(job.blocks[i])} changed during the copy (epoch "
                f"{int(job.epochs[i])} -> {int(epoch_now[i])}, committed columns {int(job.columns[i])} -> "
                f"{int(cols_now[i])}); the replica is not published"
            )

    def _copy_in(self, job: _Job) -> TransferReport:
        """Host -> Device: stage the pages' Host replicas, in logical order, as pending writes to
        Device pages ``job.ids`` (the next round work carries them; the extent may go at once)."""
        s = job.slots
        job.rt.stage_host_restores(s, job.ids)
        runs = int(coalesce_runs(np.asarray(job.ids, np.int64))[0].size) if s.size else 0
        return TransferReport(pages=int(s.size), runs=runs, chunks=runs, bytes=int(s.size) * job.table.layout.stride,
                              path="work")

    # -- offload ----------------------------------------------------------------------------------------------
    def plan_offload(self, spaces: Mapping[PoolKind, int], serial_of) -> "OffloadPlan":
        """Reserve the destination extents and pin the pages of an offload (placement -> Both after
        :meth:`complete_offload`).

        One extent per pool, for that pool's pages without a valid Host replica, in logical order;
        the allocation recipe of every pool is validated as a whole before anything is allocated.
        ``serial_of(kind, ids)`` is the work serial a state must have reached to hold the pages'
        current content.
        """
        jobs = []
        for kind, space in spaces.items():
            pg = self.rts[kind].pages
            slots = self._pages(kind, space)
            todo = ~self.tables[kind].valid(slots)
            if not todo.any():
                continue
            self._refuse_pinned(kind, pg.pins[slots] * todo, "offload")
            if (pg.device_page[slots[todo]] < 0).any():
                raise InvariantError(f"pool {kind.value}: a page has neither a Device nor a valid Host replica")
            jobs.append(self._job(kind, slots, todo))
        if not jobs:
            return self._new_plan([], {}, 0)
        recipe = [("allocate", j.table.layout.extent_bytes(j.slots.size), j.table.tag) for j in jobs]
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
            pg = job.rt.pages
            job.extent = extent
            job.ids = pg.device_page[job.slots].copy()
            job.id_gens = pg.device_gen[job.slots].copy()
            job.rt.pin(job.slots)
            b = bucket(job.slots.size, ladder(1, 2, job.rt.pool.capacity))
            ids = np.zeros(b, np.int32)
            ids[: job.slots.size] = job.ids
            pages[job.kind] = ids
            min_serial = max(min_serial, serial_of(job.kind, job.ids))
        return self._new_plan(jobs, pages, min_serial)

    def _new_plan(self, jobs: list, pages: dict, min_serial: int) -> OffloadPlan:
        self._plans += 1
        plan = OffloadPlan(self, jobs, pages, min_serial, token=self._plans, store=self.identity)
        self.in_flight[plan.token] = plan
        return plan

    def _release_plan(self, plan: "OffloadPlan") -> None:
        for job in plan.jobs:
            job.rt.unpin(job.slots)
            self.arena.free(job.extent)
        plan.status = "cancelled"
        self.in_flight.pop(plan.token, None)

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, OffloadPlan):
            raise TypeError(f"expected an OffloadPlan, got {type(plan).__name__}")
        if plan.tier is not self:
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
                f"store.gather_offload(plan, state) returns: it names the plan it was gathered for), got "
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

    def gather_in_place(self, plan: "OffloadPlan", planes_of: Callable[[PoolKind], Mapping], serial: int) -> OffloadPayload:
        """The payload of ``plan`` read straight from host-addressable planes into the plan's own
        extents (one copy; a CPU device's planes are host memory): ``planes_of(kind)`` gives the
        pool's planes as arrays numpy reads in place, ``serial`` the state's applied-work serial.

        The payload's planes are the extents' pages, so :meth:`complete_offload` finds them in
        place and only verifies and publishes.  Writing the extents now is harmless whatever
        follows: they are this plan's until it completes or is cancelled.
        """
        self._check_plan(plan)
        planes = {}
        for job in plan.jobs:
            views = job.table.layout.page_planes(self.arena.view(job.extent))
            axis = job.table.layout.layout.order.page_axis
            source = {name: np.asarray(x) for name, x in planes_of(job.kind).items()}
            for name, view in views.items():  # one gather of the plan's pages (logical order), as bytes
                copy_blocks(view[: job.ids.size], np.moveaxis(source[name], axis, 0), job.ids)
            planes[job.kind] = views
        request = plan.request
        return OffloadPayload(request.store, request.token, np.asarray(serial, np.int32), request.pages, planes)

    def cancel_offload(self, plan: "OffloadPlan") -> None:
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

    def complete_offload(self, plan: "OffloadPlan", payload) -> HostTransferReport:
        """Copy the gathered payload into the plan's extents, verify epoch and coverage, publish.

        ``payload`` is the :class:`OffloadPayload` :func:`~ninfer_kv.gather_pages` returned for
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
                self._verify(job, restore=False)
            self.fault("offload_publish", None)
        except BaseException:
            self._release_plan(plan)
            raise
        # -- publish (infallible), then release what the new replicas replace ---------------------------------
        for job in plan.jobs:
            pg = job.rt.pages
            replaced = job.slots[pg.host_page[job.slots] >= 0]  # stale replicas
            if replaced.size:
                job.table.detach(replaced)
            job.table.attach(job.slots, job.extent, job.epochs, job.columns)
            job.rt.unpin(job.slots)
        plan.status = "completed"
        self.in_flight.pop(plan.token, None)
        report = HostTransferReport.combine("offload", {j.kind: j.report for j in plan.jobs})
        self.stats.offloaded_pages += report.pages
        self.stats.offloaded_bytes += report.bytes
        return report

    def _copy_out(self, job: _Job, planes: Mapping) -> TransferReport:
        """Device -> Host: the gathered pages (logical order) into the job's extent."""
        n = int(job.slots.size)
        views = job.table.layout.page_planes(self.arena.view(job.extent))
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
        return TransferReport(pages=n, runs=runs, chunks=1 if not in_place else runs, bytes=n * job.table.layout.stride,
                              path="in place" if in_place else "gather")

    # -- Device replica release ---------------------------------------------------------------------------------
    def drop_device(self, spaces: Mapping[PoolKind, int]) -> int:
        """Release the Device leases of a checkpoint's pages (placement Both -> Host-only).

        Refused (nothing changed) when a page with a Device lease has no valid Host replica, is
        pinned, or is referenced by an active address space.  Returns the leases released.
        """
        plans = []
        for kind, space in spaces.items():
            rt = self.rts[kind]
            pg = rt.pages
            slots = self._pages(kind, space)
            on = pg.device_page[slots] >= 0
            if not on.any():
                continue
            self._refuse_pinned(kind, pg.pins[slots] * on, "drop_device_replica")
            active = np.flatnonzero(on & (pg.active_refs[slots] > 0))
            if active.size:
                raise LifecycleError(
                    f"pool {kind.value}: cannot drop the Device replica of logical blocks {active.tolist()}: an "
                    f"active address space reads them (pages of active sequences stay on Device)"
                )
            missing = np.flatnonzero(on & ~self.tables[kind].valid(slots))
            if missing.size:
                raise LifecycleError(
                    f"pool {kind.value}: cannot drop the Device replica of logical blocks {missing.tolist()}: they "
                    f"have no valid Host replica (offload_checkpoint first)"
                )
            plans.append((rt, slots[on]))
        released = 0
        for rt, sel in plans:
            pg = rt.pages
            rt.drop_device_replicas(sel)
            released += int(sel.size)
        self.stats.dropped_device_pages += released
        return released

    # -- restore ------------------------------------------------------------------------------------------------
    def _restore_jobs(self, spaces: Mapping[PoolKind, int], verb: str) -> list[_Job]:
        jobs = []
        for kind, space in spaces.items():
            pg = self.rts[kind].pages
            slots = self._pages(kind, space)
            off = pg.device_page[slots] < 0
            if not off.any():
                continue
            self._refuse_pinned(kind, pg.pins[slots] * off, verb)
            job = self._job(kind, slots, off)
            if not pg.host_valid(job.slots, job.columns).all():
                raise InvariantError(f"pool {kind.value}: a Host-only page has no valid Host replica")
            jobs.append(job)
        return jobs

    def _publish_restored(self, job: _Job) -> None:
        job.rt.publish_device_replicas(job.slots, job.ids, job.id_gens)
        job.rt.unpin(job.slots)
        self.stats.restored_pages += job.report.pages
        self.stats.restored_bytes += job.report.bytes

    def restore(self, spaces: Mapping[PoolKind, int], *, drop_host: bool = False) -> HostTransferReport:
        """Host -> Device for every Host-only page of a checkpoint (placement -> Both, or Device with
        ``drop_host``).  Device pages come from each pool's available pages."""
        jobs = self._restore_jobs(spaces, "restore_checkpoint")
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
            taken: list[_Job] = []
            pinned: list[_Job] = []
            marks = [(job.rt, job.rt.mark_writes()) for job in jobs]
            try:
                for job in jobs:
                    job.ids, job.id_gens = job.rt.acquire_pages(job.slots.size)
                    taken.append(job)
                for job in jobs:
                    job.rt.pin(job.slots)
                    pinned.append(job)
                for job in jobs:
                    self.fault("restore_copy", job.kind)
                    job.report = self._copy_in(job)
                for job in jobs:
                    self.fault("restore_verify", job.kind)
                    self._verify(job, restore=True)
                self.fault("restore_publish", None)
            except BaseException:
                for rt, mark in reversed(marks):
                    rt.rollback_writes(mark)
                for job in pinned:
                    job.rt.unpin(job.slots)
                for job in taken:
                    job.rt.undo_acquire_pages(job.ids)
                raise
            for job in jobs:
                self._publish_restored(job)
        report = HostTransferReport.combine("restore", {j.kind: j.report for j in jobs})
        if drop_host:
            self.release_host(spaces)
        return report

    def restore_for_activation(self, kind: PoolKind, space: int, row: int, blocks: int | None = None
                               ) -> Callable[[], None]:
        """Activation stage ``restore_host`` for one pool: restore the Host-only pages among the
        source's first ``blocks`` logical blocks (``None``: all of them; an activation from a prefix
        reads no page beyond it) into Device pages materialized from ``row``'s reservation (which the
        ``reserve`` stage enlarged by their count).  Returns the exact undo: Device pages back to the
        reservation, Host replicas untouched, counters restored."""
        pg = self.rts[kind].pages
        slots = self._pages(kind, space)[:blocks]
        off = pg.device_page[slots] < 0
        if not off.any():
            return lambda: None
        self._refuse_pinned(kind, pg.pins[slots] * off, "activation restore")
        job = self._job(kind, slots, off)
        if not pg.host_valid(job.slots, job.columns).all():
            raise InvariantError(f"pool {kind.value}: a Host-only page has no valid Host replica")
        rt = job.rt
        job.ids, job.id_gens = rt.materialize_pages(row, job.slots.size)
        rt.pin(job.slots)
        mark = rt.mark_writes()
        try:
            self.fault("restore_copy", kind)
            job.report = self._copy_in(job)
            self.fault("restore_verify", kind)
            self._verify(job, restore=True)
        except BaseException:
            rt.rollback_writes(mark)
            rt.unpin(job.slots)
            rt.undo_materialize_pages(row, job.ids)
            raise
        self._publish_restored(job)
        stats = self.stats

        def undo():
            rt.rollback_writes(mark)
            rt.unpublish_device_replicas(job.slots)
            rt.undo_materialize_pages(row, job.ids)
            stats.restored_pages -= job.report.pages
            stats.restored_bytes -= job.report.bytes

        return undo

    # -- Host replica release --------------------------------------------------------------------------------------
    def _check_release_host(self, spaces: Mapping[PoolKind, int], *, restoring: bool = False) -> list:
        plans = []
        for kind, space in spaces.items():
            pg = self.rts[kind].pages
            slots = self._pages(kind, space)
            hosted = pg.host_page[slots] >= 0
            if not hosted.any():
                continue
            self._refuse_pinned(kind, pg.pins[slots] * hosted, "release_host_replica")
            only = np.flatnonzero(hosted & (pg.device_page[slots] < 0))
            if only.size and not restoring:
                raise LifecycleError(
                    f"pool {kind.value}: cannot release the Host replica of logical blocks {only.tolist()}: it is "
                    f"their only copy (restore_checkpoint first)"
                )
            plans.append((kind, slots[hosted]))
        return plans

    def release_host(self, spaces: Mapping[PoolKind, int]) -> int:
        """Release the Host replicas of a checkpoint's pages (placement Both -> Device-only).

        Refused (nothing changed) when a page is Host-only or pinned.  Pages shared with other
        checkpoints lose their Host replica too (it is the page's).  Returns the replicas released.
        """
        released = 0
        for kind, sel in self._check_release_host(spaces):
            self.tables[kind].detach(sel)
            released += int(sel.size)
        self.stats.released_host_pages += released
        return released

    # -- inspection ---------------------------------------------------------------------------------------------
    def placement(self, spaces: Mapping[PoolKind, int]) -> tuple[str, dict]:
        dev, host = [], []
        for kind, space in spaces.items():
            slots = self._pages(kind, space)
            dev.append(self.rts[kind].pages.device_page[slots] >= 0)
            host.append(self.tables[kind].valid(slots))
        if not dev:
            return placement_of(np.zeros(0, bool), np.zeros(0, bool))
        return placement_of(np.concatenate(dev), np.concatenate(host))

    def occupancy(self) -> HostOccupancy:
        return HostOccupancy(
            arena=self.arena.occupancy(),
            memory_kind=self.arena.memory_kind,
            pools={kind: t.occupancy() for kind, t in self.tables.items()},
            stats=self.stats.copy(),
        )

    def check_invariants(self) -> None:
        try:
            self.arena.check_invariants()
        except AssertionError as exc:
            raise InvariantError(f"host arena: {exc}") from None
        held = sum(len(t.users) for t in self.tables.values())
        reserved = sum(len(p.jobs) for p in self.in_flight.values())
        if held + reserved != self.arena.occupancy().extent_count:
            raise InvariantError(
                f"host arena holds {self.arena.occupancy().extent_count} extents but the pools reference {held} and "
                f"offload plans in flight reserve {reserved}"
            )
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

    def snapshot(self) -> dict:
        """What the tier holds: the arena's extents and free ranges, each pool's extent users and the
        plans in flight (by token) — state, not counters, so a rolled-back verb snapshots the same."""
        return {
            "arena": self.arena.describe(),
            "extents": {kind.value: t.snapshot() for kind, t in self.tables.items()},
            "in_flight": sorted(self.in_flight),
        }
