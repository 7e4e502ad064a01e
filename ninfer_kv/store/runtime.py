"""PoolRuntime: everything the store keeps for one pool, and the per-pool transitions.

One runtime bundles a :class:`DevicePagePool` (physical IDs, reservations, leases), a
:class:`LogicalPageTable` (descriptors), an :class:`AddressSpaceTable` (memberships and
frontiers), a :class:`BlockTableMatrix` (host mirror and pending updates), the pool's pending
:class:`~ninfer_kv.store.page_writes.PageWrites` (COW copies and Host restores for the next work)
and its :class:`FrontierHistory` (what each work dates).  It holds no device array.

It is the one composer of those tables: no other object calls their transitions (enforced by
``tests/store/test_table_ownership.py``).  Others read the tables directly (``rt.pages.refs``,
``rt.spaces.pages_of(s)``, ``rt.pool.available``); every change goes through a method here that
is a transition of the pool, not of one table: the verbs the :class:`~ninfer_kv.store.KVStore`
facade composes (vectorized mapping / commit / trim over execution rows, activation pieces that
return exact undo actions, deactivation and release, the repair work) and the steps of the Host
tier's two state machines (offload: :meth:`PoolRuntime.begin_offload` ->
:meth:`PoolRuntime.publish_offload` or :meth:`PoolRuntime.unpin`; restore:
:meth:`PoolRuntime.begin_restore` -> :meth:`PoolRuntime.stage_host_restores` ->
:meth:`PoolRuntime.publish_restore` or :meth:`PoolRuntime.cancel_restore`).

Vectorized methods validate every input before they change anything.

With a Host tier, ``host_replicas`` is the pool's
:class:`~ninfer_kv.store.pool_host_replicas.PoolHostReplicas`: a page of an inactive checkpoint may
then have no Device replica (placement Host-only).  Pages referenced by an active address space
always have one.  When a descriptor's last reference and pin go, its Device lease and its Host
extent membership are both released before it is reclaimed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..schema.geometry import PAGE_SIZE
from ..planning import PoolPlan
from ..schema.kinds import PoolKind
from .address_space import AddressSpaceTable
from ..schema.geometry import SENTINEL_PAGE
from ..schema.round_work import PendingWork, PoolWork
from .block_tables import BlockTableMatrix
from ..schema.errors import EntitlementError, InvariantError, LifecycleError
from ..host import HostExtent, HostKVArena
from .frontier_history import DEFAULT_WINDOW, FrontierHistory
from .logical_page import LogicalPageTable
from .pool import DevicePagePool
from .pool_host_replicas import PoolHostReplicas
from .page_writes import PageWrites

__all__ = ["PoolRuntime", "RestoreTargets"]

_SHIFT = PAGE_SIZE.bit_length() - 1
assert 1 << _SHIFT == PAGE_SIZE

Undo = Callable[[], None]


def _runs(rows: np.ndarray, first: np.ndarray, counts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(owner rows, blocks)``: ``counts[i] >= 1`` consecutive blocks of ``rows[i]`` from block
    ``first[i]``, ``k`` in all."""
    if k == rows.size:
        return rows, first
    owner = np.repeat(rows, counts)
    return owner, np.arange(k) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(first, counts)


class RestoreTargets(NamedTuple):
    """The Device pages a restore of Host-only pages writes (:meth:`PoolRuntime.begin_restore`):
    leases ``(ids, generations)`` taken from the available pages (``row`` ``None``) or from
    ``row``'s reservation, and ``mark``, the pending page writes before the copy."""

    ids: np.ndarray
    generations: np.ndarray
    row: int | None
    mark: tuple[int, int]


class PoolRuntime:
    """The state of one pool of a :class:`KVStore`."""

    def __init__(self, plan: PoolPlan, *, lead_tokens: int, history_window: int = DEFAULT_WINDOW) -> None:
        self.kind: PoolKind = plan.kind
        self.layout = plan.layout
        self.page_size = PAGE_SIZE
        self.rows = plan.max_concurrency
        self.logical_pages = plan.logical_pages
        self.lead_tokens = int(lead_tokens)
        name = plan.kind.value
        self.pool = DevicePagePool(plan.physical_pages, owners=self.rows, name=name)
        self.pages = LogicalPageTable(plan.physical_pages, pool=name)
        self.spaces = AddressSpaceTable(self.rows, self.logical_pages, pool=name)
        self.table = BlockTableMatrix(self.rows, self.logical_pages)
        self.writes = PageWrites(plan.layout, plan.physical_pages)
        self.history = FrontierHistory(self.rows, history_window)
        self.host_replicas: PoolHostReplicas | None = None  # with a Host tier (attach_host)
        self._fills = 0  # page writes recorded so far (their order, for a replay)

    # -- round work -------------------------------------------------------------------------------------
    def take_work(self, writes: PageWrites | None = None) -> PoolWork:
        """This pool's part of the next round work: the dirty table entries and the pending page
        writes (or ``writes`` instead, leaving the pending ones for the next take, which their pages'
        fill records then name); dates the take."""
        if writes is not None:
            self.pages.defer_fills(self.history.takes)
        copies, restores, payload = (self.writes if writes is None else writes).take()
        work = PoolWork(tables=self.table.take(), copies=copies, restores=restores, payload=payload,
                        pad_row=self.rows, pad_page=self.pool.capacity)
        self.history.record_take(self.spaces.committed[: self.rows])
        return work

    def pending_work(self) -> PendingWork:
        """What this pool's part of the next take will hold (distinct entries that carry work)."""
        copies, restores = self.writes.counts()
        return PendingWork(tables=self.table.pending, copies=copies, restores=restores)

    def _record_fills(self, slots: np.ndarray, src: np.ndarray, src_gen: np.ndarray, columns: np.ndarray) -> None:
        """The Device pages of ``slots`` are filled by the next work, in the order recorded: copies of
        ``columns`` columns from pages ``src`` (generations ``src_gen``), or Host restores (``src == -1``)."""
        n = int(np.size(slots))
        seq = np.arange(self._fills, self._fills + n, dtype=np.int64)
        self._fills += n
        self.pages.record_fill(slots, self.history.takes, seq, src, src_gen, columns)

    # -- transitions the Host tier composes (it changes pool and page state only through these) ---------
    def attach_host(self, arena: HostKVArena) -> PoolHostReplicas:
        """Give this pool its Host replica table over ``arena`` (the store's Host tier does, once)."""
        self.host_replicas = PoolHostReplicas(self.pages, self.layout, self.kind.value, arena)
        return self.host_replicas

    def host_replica_valid(self, slots: np.ndarray) -> np.ndarray:
        """Per page: a Host replica valid for the page's committed columns."""
        return self.pages.host_valid(slots, self.page_committed(slots))

    def begin_offload(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The Device replicas of ``slots`` become the sources of an offload copy: each page gets a
        transaction pin (nothing releases, trims or rewrites it until :meth:`publish_offload` or
        :meth:`unpin`).  Returns their leases ``(ids, generations)``."""
        pg = self.pages
        leases = pg.device_page[slots].copy(), pg.device_gen[slots].copy()
        pg.pin(slots)
        return leases

    def publish_offload(self, slots: np.ndarray, extent: HostExtent, epochs: np.ndarray,
                        coverages: np.ndarray) -> None:
        """Publish a verified offload (infallible): page ``i`` of ``extent`` becomes the Host replica
        ``(epochs[i], coverages[i])`` of ``slots[i]``, replacing a stale one; the copy's pins go."""
        pg = self.pages
        stale = slots[pg.host_page[slots] >= 0]
        if stale.size:
            self.release_host_replicas(stale)
        pg.publish_host_replicas(slots, extent, epochs, coverages)
        self.host_replicas.hold(extent, slots.size)
        self.unpin(slots)

    def release_host_replicas(self, slots: np.ndarray) -> None:
        """Drop the Host replicas of ``slots``; an extent whose last page goes is freed (infallible)."""
        self.host_replicas.release(self.pages.clear_host_replicas(slots))

    def begin_restore(self, slots: np.ndarray, row: int | None = None) -> RestoreTargets:
        """Lease a Device page for each Host-only page of ``slots`` — from the available pages
        (``row`` ``None``) or from ``row``'s reservation — and pin the pages for the copy; the
        leases stay unpublished until :meth:`publish_restore` (or go back by :meth:`cancel_restore`)."""
        mark = self.writes.mark()
        if row is None:
            ids, gens = self.pool.acquire(slots.size)
        else:
            ids, gens = self.pool.materialize(row, slots.size)
        self.pages.pin(slots)
        return RestoreTargets(ids, gens, row, mark)

    def stage_host_restores(self, slots: np.ndarray, ids: np.ndarray, writes: PageWrites | None = None) -> None:
        """Record the Host replicas of ``slots`` as whole-page writes onto Device pages ``ids``
        (logical order) in the pending page writes (the next work), or in ``writes`` (a repair's)."""
        into = self.writes if writes is None else writes
        for dst, planes, index in self.host_replicas.restore_sources(slots, ids):
            into.restore(dst, planes, index)

    def _return_leases(self, targets: RestoreTargets) -> None:
        """Forget the page writes staged since ``targets`` began and give its leases back."""
        self.writes.rollback(targets.mark)
        if targets.row is None:
            self.pool.undo_acquire(targets.ids)
        else:
            self.pool.undo_materialize(targets.row, targets.ids)

    def cancel_restore(self, slots: np.ndarray, targets: RestoreTargets) -> None:
        """Exact inverse of :meth:`begin_restore` and the staging after it (before publication)."""
        self.unpin(slots)
        self._return_leases(targets)

    def publish_restore(self, slots: np.ndarray, targets: RestoreTargets) -> None:
        """The leases of ``targets`` become the Device replicas of ``slots``, filled from their Host
        replicas by the next work (a fill record each); the copy's pins go."""
        n = int(slots.size)
        self.pages.set_device(slots, targets.ids, targets.generations)
        self._record_fills(slots, np.full(n, -1), np.zeros(n, np.int64), np.full(n, PAGE_SIZE))
        self.unpin(slots)

    def undo_restore(self, slots: np.ndarray, targets: RestoreTargets) -> None:
        """Exact inverse of a published restore (an activation's rollback): the pages are Host-only
        again, the staged page writes forgotten, the leases back where they came from."""
        self.pages.clear_device(slots)
        self._return_leases(targets)

    def drop_device_replicas(self, slots: np.ndarray) -> None:
        """Release the Device leases of ``slots`` (their Host replicas remain)."""
        pg = self.pages
        self.pool.release(pg.device_page[slots], pg.device_gen[slots])
        pg.clear_device(slots)

    # -- repair work ------------------------------------------------------------------------------------
    def take_repair_work(self, replays: PageWrites, quarantined: list[int]) -> PoolWork:
        """This pool's part of a resync's repair work: rows ``quarantined`` (whose content is lost)
        get sentinel block-table rows, every block-table entry is republished and ``replays`` are
        the page writes (:meth:`take_work` with ``writes``)."""
        for row in quarantined:
            self.table.clear_row(row)
        self.table.mark_all()
        return self.take_work(writes=replays)

    # -- derived page state -----------------------------------------------------------------------------
    def page_committed(self, slots: np.ndarray) -> np.ndarray:
        """Committed columns of pages (derived from the writer's frontier while a writer exists)."""
        pg = self.pages
        w = pg.writer[slots]
        stored = pg.committed[slots]
        has = w >= 0
        if not has.any():
            return stored
        derived = np.clip(self.spaces.committed[np.where(has, w, 0)] - pg.writer_block[slots] * PAGE_SIZE, 0, PAGE_SIZE)
        return np.where(has, derived, stored)

    # -- mapping ----------------------------------------------------------------------------------------
    def check_map(self, rows: np.ndarray, targets: np.ndarray) -> np.ndarray | None:
        """Raise :class:`EntitlementError` (changing nothing) when a target needs more pages than its
        row's entitlement.  Returns the rows' positions whose target crosses their mapped extent
        (``None`` when none does), which :meth:`map_rows` takes as ``crossing``."""
        sp = self.spaces
        cross = targets > sp.mapped[rows]
        if not cross.any():
            return None
        r, t = rows[cross], targets[cross]
        over = ((t + (PAGE_SIZE - 1)) >> _SHIFT) > sp.ent_pages[r]
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise EntitlementError(
                f"pool {self.kind.value}: row {int(r[i])} asks to map {int(t[i])} tokens but its entitlement "
                f"covers {int(sp.ent_pages[r[i]]) * PAGE_SIZE} tokens ({int(sp.ent_pages[r[i]])} pages)"
            )
        return cross.nonzero()[0]

    def map_rows(self, rows: np.ndarray, targets: np.ndarray, crossing: np.ndarray | None | bool = False) -> int:
        """Make each row's membership cover ``targets[i]`` tokens (a lower bound); returns new pages.

        ``rows`` are distinct active rows (validated by the store's :class:`ExecutionRows`).
        No-op for rows already covering their target; fails (changing nothing) when a target needs
        more pages than the row's entitlement (:meth:`check_map`).  New pages convert the row's own
        reservation into leases.  Never moves a frontier, never trims, never changes an entitlement.
        """
        sp = self.spaces
        if crossing is False:  # not checked by the caller: check (raises) and find the crossing rows
            crossing = self.check_map(rows, targets)
        if crossing is None:
            return 0
        idx = crossing
        r = rows[idx]
        t = targets[idx]
        need = (t + (PAGE_SIZE - 1)) >> _SHIFT
        n = r.size
        have = sp.n_blocks[r]
        counts = need - have
        k = sum(counts.tolist()) if n <= 64 else int(counts.sum())  # small sets: Python is cheaper
        # reservation == entitlement - mapped pages for every active row, so it covers ``counts``
        ids, gens = self.pool.materialize_many(r, counts, checked=False, total=k)
        owner, blocks = _runs(r, have, counts, k)
        slots = self.pages.create(ids, gens, owner, blocks)
        sp.append_blocks(r, owner, blocks, slots, need)
        self.table.write(owner, blocks, ids)
        return k

    # -- frontiers ----------------------------------------------------------------------------------------
    def check_commit(self, rows: np.ndarray, frontiers: np.ndarray) -> np.ndarray:
        """Raise (changing nothing) unless every frontier lies in ``[committed, mapped]`` of its row;
        returns the rows' committed frontiers (what :meth:`commit_rows` takes as ``committed``)."""
        sp = self.spaces
        old = sp.committed[rows]
        bad = (frontiers < old) | (frontiers > sp.mapped[rows])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            r, f = int(rows[i]), int(frontiers[i])
            if f < old[i]:
                raise LifecycleError(
                    f"pool {self.kind.value}: row {r} commit to {f} would move the committed frontier "
                    f"{int(old[i])} backwards; use truncate"
                )
            raise EntitlementError(
                f"pool {self.kind.value}: row {r} commit to {f} exceeds its mapped extent "
                f"{int(sp.mapped[r])} tokens; map first"
            )
        return old

    def commit_rows(self, rows: np.ndarray, frontiers: np.ndarray, committed: np.ndarray | None = None) -> None:
        """Advance committed frontiers of distinct active rows after a successful unit (within the
        mapped extent).  ``committed``: what :meth:`check_commit` returned for these rows (the
        check is then not repeated)."""
        if committed is None:
            committed = self.check_commit(rows, frontiers)
        self.history.record_commit(rows, frontiers != committed)
        self.spaces.set_committed(rows, frontiers)

    def _trimmed(self, rows: np.ndarray, keep_tokens: np.ndarray, committed: np.ndarray | None = None):
        """The ``(rows, kept blocks, owner rows, blocks)`` a trim to ``max(committed, keep_tokens)``
        unmaps (``None`` when nothing is trimmed)."""
        sp = self.spaces
        keep = np.maximum(sp.committed[rows] if committed is None else committed, keep_tokens)
        keep_blocks = (keep + (PAGE_SIZE - 1)) >> _SHIFT
        nb = sp.n_blocks[rows]
        over = nb > keep_blocks
        if not over.any():
            return None
        r = rows[over]
        kb = keep_blocks[over]
        counts = nb[over] - kb
        k = int(counts.sum())
        owner, blocks = _runs(r, kb, counts, k)
        return r, kb, owner, blocks

    def check_trim(self, rows: np.ndarray, keep_tokens: np.ndarray, committed: np.ndarray | None = None) -> None:
        """Raise :class:`LifecycleError` (changing nothing) when a trim to ``max(committed,
        keep_tokens)`` (``committed``: the rows' frontiers after a commit, default their current
        ones) would unmap a page pinned by an in-flight copy."""
        cut = self._trimmed(rows, keep_tokens, committed)
        if cut is not None and (self.pages.pins[self.spaces.membership[cut[2], cut[3]]] != 0).any():
            raise LifecycleError(f"pool {self.kind.value}: cannot trim pages pinned by an in-flight copy")

    def trim_rows(self, rows: np.ndarray, keep_tokens: np.ndarray) -> int:
        """Keep ``ceil(max(committed, keep_tokens) / P)`` pages per row; returns pages trimmed.

        Trimmed Device leases go back to the row's own reservation, not to the global pool.
        Refused (:meth:`check_trim`, nothing changed) when a trimmed page is pinned.
        """
        sp = self.spaces
        cut = self._trimmed(rows, keep_tokens)
        if cut is None:
            return 0
        r, kb, owner, blocks = cut
        k = int(owner.size)
        pg = self.pages
        slots = sp.membership[owner, blocks]
        if (pg.pins[slots] != 0).any():
            raise LifecycleError(f"pool {self.kind.value}: cannot trim pages pinned by an in-flight copy")
        if (pg.refs[slots] != 1).any() or (pg.writer[slots] != owner).any():
            raise InvariantError(f"pool {self.kind.value}: trimming a page this row does not own privately")
        self.pool.dematerialize_many(pg.device_page[slots], pg.device_gen[slots], owner)
        pg.drop_private(slots)
        sp.drop_blocks(r, owner, blocks, kb)
        self.table.write(owner, blocks, SENTINEL_PAGE)
        return k

    def settle_rows(self, rows: np.ndarray, accepted: np.ndarray, keep_tokens: np.ndarray) -> int:
        """Commit ``accepted`` frontiers, then trim to ``max(accepted, keep_tokens)``; all or nothing
        (a refused trim leaves the frontiers as they were).  Returns pages trimmed."""
        saved = self.spaces.committed[rows]
        dated = self.history.save_rows(rows)
        self.commit_rows(rows, accepted)
        try:
            return self.trim_rows(rows, keep_tokens)
        except BaseException:
            self.spaces.set_committed(rows, saved)
            self.history.restore_rows(rows, dated)
            raise

    def truncate_row(self, row: int, frontier: int, keep_tokens: int) -> None:
        """Withdraw committed tokens ``[frontier, committed)`` and trim (validated by the caller)."""
        sp, pg = self.spaces, self.pages
        old = int(sp.committed[row])
        if frontier < old:
            first = frontier >> _SHIFT
            last = min(int(sp.n_blocks[row]), -(-old // PAGE_SIZE))
            if last > first:
                pg.bump_epoch(sp.membership[row, first:last])
        sp.set_committed(row, frontier)
        self.history.record_truncate(row, frontier)
        self.trim_rows(np.array([row]), np.array([keep_tokens], np.int64))

    # -- references ---------------------------------------------------------------------------------------
    def drop_references(self, slots: np.ndarray) -> None:
        """Remove one address-space reference from each page; release and reclaim unreferenced ones."""
        if slots.size == 0:
            return
        dead = self.pages.drop_refs(slots)
        if dead.size:
            self._release_dead(dead)

    def unpin(self, slots: np.ndarray) -> None:
        """Drop a transaction pin; pages left with no reference and no pin are released."""
        pg = self.pages
        pg.drop_pin(slots)
        dead = slots[(pg.pins[slots] == 0) & (pg.refs[slots] == 0) & pg.live[slots]]
        if dead.size:
            self._release_dead(dead)

    def _release_dead(self, dead: np.ndarray) -> None:
        """Release every replica of pages with no reference and no pin, then reclaim them."""
        pg = self.pages
        dev = pg.device_page[dead]
        on = dev >= 0
        if on.all():
            self.pool.release(dev, pg.device_gen[dead])
        elif on.any():
            self.pool.release(dev[on], pg.device_gen[dead][on])
        pg.clear_device(dead)
        pg.clear_writer(dead)
        hosted = dead[pg.host_page[dead] >= 0]
        if hosted.size:
            self.release_host_replicas(hosted)
        pg.reclaim(dead)

    # -- activation pieces (each returns its exact undo) ----------------------------------------------------
    def claim(self, row: int, bundle: int, ent_pages: int, target: int, growth: bool) -> Undo:
        """Make the free row slot ``row`` live (empty membership) in bundle ``bundle``, with
        ``ent_pages`` pages of entitlement towards ``target`` tokens."""
        sp = self.spaces
        sp.claim(row, bundle, ent_pages, target, growth)
        return lambda: sp.clear(row, bump=False)

    def reserve(self, row: int, count: int) -> Undo:
        """``count`` more available Device pages reserved for ``row``."""
        self.pool.reserve(row, count)
        return lambda: self.pool.unreserve(row, count)

    def carry(self, row: int, src: int, blocks: int, committed: int) -> Undo:
        """Reference the first ``blocks`` pages of inactive space ``src`` from ``row`` (Move or Fork)."""
        sp, pg = self.spaces, self.pages
        slots = sp.membership[src, :blocks].copy()
        sp.set_prefix(row, slots, committed)
        pg.add_refs(slots, active=True)

        def undo():
            pg.unref(slots, active=True)
            sp.clear_prefix(row, blocks)

        return undo

    def private_tail(self, row: int, src_page_slot: int, block: int, columns: int) -> Undo:
        """COW: a private page for ``block`` holding ``columns`` columns copied from ``src_page_slot``.

        The copy is recorded for the next round work (the device performs it in ``apply_work``).
        """
        sp, pg = self.spaces, self.pages
        ids, gens = self.pool.materialize(row, 1)
        slot = self.pages.create(ids, gens, row, block)
        mark = self.writes.mark()
        self.writes.copy(pg.device_page[src_page_slot], ids[0], columns)
        self._record_fills(slot, np.array([src_page_slot]), pg.generation[[src_page_slot]], np.array([columns]))
        sp.push_tail(row, block, slot[0], block * PAGE_SIZE + columns)

        def undo():
            self.writes.rollback(mark)
            sp.pop_tail(row, block)
            self.pages.discard(slot)
            self.pool.undo_materialize(row, ids)

        return undo

    def publish_row(self, row: int) -> Undo:
        """Row ``row``'s block-table row mirrors its membership (published by the next take)."""
        saved = self.table.save_row(row)
        slots = self.spaces.pages_of(row)
        self.table.write_row(row, self.pages.device_page[slots].astype(np.int32))
        return lambda: self.table.restore_row(row, saved)

    def commit_activation(self, row: int, source: int | None, moved: bool) -> None:
        """Final, infallible part of activation from checkpoint slot ``source`` (``None``: the root):
        date the carried content, retire a Move source, set writers, go active."""
        sp, pg = self.spaces, self.pages
        self.history.record_activation(row, int(sp.committed[row]), source)
        if moved:
            src_slots = sp.pages_of(source).copy()
            pg.retire_source(src_slots)  # no surviving checkpoint needs columns of pages it held alone
            sp.clear(source, bump=True)
            self.history.record_release(source)
        slots = sp.pages_of(row)
        shared = np.flatnonzero(pg.refs[slots] > 1)
        protected_blocks = int(shared[-1]) + 1 if shared.size else 0
        protected = min(protected_blocks * PAGE_SIZE, int(sp.committed[row]))
        own = slots[protected_blocks:]
        hosted = own[pg.host_page[own] >= 0]
        if hosted.size:  # a writable page keeps no Host replica: its content is about to move on
            self.release_host_replicas(hosted)
        pg.set_writer(own, row, np.arange(protected_blocks, slots.size))
        sp.activate(row, protected)

    # -- deactivation -----------------------------------------------------------------------------------------
    def check_deactivate(self, row: int, retain: bool) -> None:
        """Raise (changing nothing) if :meth:`deactivate` could not complete.

        Retaining trims provisional pages, which must not be pinned; releasing defers the release of
        pinned pages to their last unpin.
        """
        if not retain:
            return
        sp, pg = self.spaces, self.pages
        slots = sp.pages_of(row)
        first = -(-int(sp.committed[row]) // PAGE_SIZE)
        if (pg.pins[slots[first:]] != 0).any():
            raise LifecycleError(f"pool {self.kind.value}: row {row} has pages pinned by an in-flight copy")

    def deactivate(self, row: int, retain: bool) -> int | None:
        """Leave execution: release row, writer and unmaterialized entitlement; retain or release.

        Returns the inactive slot of the retained checkpoint, or ``None`` when released.
        """
        sp, pg = self.spaces, self.pages
        if retain:
            self.trim_rows(np.array([row]), np.zeros(1, np.int64))
        self.pool.release_reservation(row)
        slots = sp.pages_of(row).copy()
        own = slots[pg.writer[slots] == row]
        columns = np.clip(int(sp.committed[row]) - pg.writer_block[own] * PAGE_SIZE, 0, PAGE_SIZE)
        pg.release_writer(own, columns)
        pg.drop_active_refs(slots)
        self.table.clear_row(row)
        if not retain:
            sp.clear(row, bump=True)
            self.drop_references(slots)
            return None
        s = sp.retain(row)
        self.history.record_retain(row, s, int(sp.committed[row]))
        pg.protect_committed(slots)
        sp.clear(row, bump=True)
        return s

    def release_inactive(self, slot: int) -> None:
        slots = self.spaces.pages_of(slot).copy()
        self.spaces.clear(slot, bump=True)
        self.history.record_release(slot)
        self.drop_references(slots)

    # -- growth -------------------------------------------------------------------------------------------------
    def grow(self, rows: np.ndarray, desired_pages: np.ndarray) -> np.ndarray:
        """Raise entitlements towards ``desired_pages`` from available pages, in row order."""
        sp = self.spaces
        want = np.maximum(desired_pages - sp.ent_pages[rows], 0)
        if not want.any():
            return want
        cum = np.cumsum(want)
        granted = np.clip(self.pool.available - (cum - want), 0, want)
        g = granted > 0
        if g.any():
            self.pool.reserve_many(rows[g], granted[g])
            sp.add_entitlement(rows[g], granted[g])
        return granted

    # -- repair -------------------------------------------------------------------------------------------------
    def plan_resync(self, dated_epoch: int, applied: int, replays: PageWrites) -> dict[int, int]:
        """What a device state that missed works still holds of this pool, and how to restore the rest.

        The state holds the tokens committed in epochs ``<= dated_epoch`` and the page writes of works
        ``< applied`` (see :mod:`.frontier_history`).  Every live page is rated by ``ok``, the columns
        of it that are correct once the repair work (the page writes recorded into ``replays``) and
        then the pending page writes (the take after it, see :meth:`take_work`) are applied.  With
        ``need`` its committed columns and ``dated`` the columns the dating gives it:

        * not on the device (Host-only): the columns its Host replica is valid for (all of them: a
          Host-only page always has a valid one).  Nothing on the device needs repair; an activation
          restores it from the Host as usual;
        * on the device, filled by a work the state missed (``applied <= fill work < taken``): 0;
          filled by a pending restore: ``need``; otherwise ``dated``;
        * then each Device page still short of ``need`` and not pending whose Host replica is valid
          for ``need``: a Host restore is replayed (first: it depends on nothing on the device), ``need``;
        * then each COW destination whose copy of ``columns`` columns was missed or is pending, in the
          order the copies were recorded (a copy reads its source as repaired before it).  ``held``:
          the copied columns that will be correct.  A missed copy is replayed by the repair work
          from the source's Device page when the source is the same live page (generation), on the
          device and not awaiting a pending restore: ``held`` is what the source holds (and what
          the repair work's earlier writes into it cover).  One its source's Device page cannot
          serve in full is replayed from the source's Host replica instead when that is valid for
          ``columns`` (a whole-page write): ``columns``.  A pending copy is performed by the next
          work as recorded, after the repair (:meth:`_pending_copy_held`).  Then ``max(columns,
          dated)`` when ``held == columns`` (the copy, and beyond it the appends the dating vouches
          for; it vouches for none a state that missed the copy could hold, so this is ``columns``
          in any history the dating rule describes), else ``held``.

        An address space is intact up to its first page short of its committed columns.  Returns
        ``{space slot: intact frontier}`` for every live address space whose committed content no
        source restores.
        """
        pg, sp, hist = self.pages, self.spaces, self.history
        taken = hist.takes
        dated = np.zeros(pg.capacity, np.int64)  # columns each Device page holds by the dating
        need = np.zeros(pg.capacity, np.int64)  # committed columns of each page
        spaces = []
        for s in np.flatnonzero(sp.live).tolist():
            slots = sp.pages_of(s)
            committed = int(sp.committed[s])
            starts = np.arange(slots.size, dtype=np.int64) * PAGE_SIZE
            if sp.active[s]:
                frontier = hist.intact_row(s, committed, dated_epoch)
            else:
                frontier = hist.intact_checkpoint(s, committed, dated_epoch)
            np.maximum.at(dated, slots, np.clip(frontier - starts, 0, PAGE_SIZE))
            cols = np.clip(committed - starts, 0, PAGE_SIZE)
            np.maximum.at(need, slots, cols)
            spaces.append((s, slots, cols))
        on_device = pg.live & (pg.device_page >= 0)
        missed = on_device & (pg.fill_work >= applied) & (pg.fill_work < taken)
        pending = on_device & (pg.fill_work >= taken)
        ok = np.where(missed, 0, dated)
        host_only = np.flatnonzero(pg.live & (pg.device_page < 0))
        if host_only.size:  # their Host replica is their content: nothing on the device to repair
            valid = pg.host_page[host_only] >= 0
            valid &= pg.host_epoch[host_only] == pg.epoch[host_only]
            ok[host_only] = np.where(valid, np.minimum(pg.host_coverage[host_only], need[host_only]), 0)
        ok[pending & (pg.fill_src < 0)] = need[pending & (pg.fill_src < 0)]  # the next work restores them
        wrote: dict[int, int] = {}  # Device page slot -> columns the repair work writes into it
        # Host replicas first: they depend on nothing on the device
        short = np.flatnonzero(on_device & ~pending & (ok < need))
        if short.size and self.host_replicas is not None:
            hosted = short[pg.host_valid(short, need[short])]
            if hosted.size:
                self.stage_host_restores(hosted, pg.device_page[hosted], replays)
                ok[hosted] = need[hosted]
                missed[hosted] = False
                wrote.update(dict.fromkeys(hosted.tolist(), PAGE_SIZE))
        # then the COW copies, in the order they were recorded
        cows = np.flatnonzero((missed | pending) & (pg.fill_src >= 0))
        for d in cows[np.argsort(pg.fill_seq[cows], kind="stable")].tolist():
            src, columns = int(pg.fill_src[d]), int(pg.fill_cols[d])
            if pending[d]:  # the next work performs it as recorded, reading what the repair leaves
                held = self._pending_copy_held(d, columns, ok, pending)
            else:  # missed: the repair work replays it, reading the source as its earlier writes leave it
                same = bool(pg.live[src]) and pg.generation[src] == pg.fill_src_gen[d]
                readable = same and pg.device_page[src] >= 0 and not pending[src]
                held = min(columns, int(ok[src]), wrote.get(src, PAGE_SIZE)) if readable else 0
                if same and held < columns and self.host_replicas is not None and pg.host_valid(np.array([src]), columns)[0]:
                    self.stage_host_restores(np.array([src]), pg.device_page[[d]], replays)
                    ok[d], wrote[d] = columns, PAGE_SIZE
                    continue
                if readable:
                    replays.copy(pg.device_page[src], pg.device_page[d], columns)
                    wrote[d] = columns
            ok[d] = max(columns, int(dated[d])) if held == columns else held
        lost = {}
        for s, slots, cols in spaces:
            short = np.flatnonzero(ok[slots] < cols)
            if short.size:
                b = int(short[0])
                lost[s] = b * PAGE_SIZE + int(ok[slots[b]])
        return lost

    def _pending_copy_held(self, d: int, columns: int, ok: np.ndarray, pending: np.ndarray) -> int:
        """Columns of the pending COW onto page ``d`` that the next work copies correctly, by what it
        reads (:class:`PageWrites` resolves it to a pre-work source): a staged Host payload holds
        them; a Device page holds what ``ok`` rates its page — the source, or along a chain of
        pending copies the page they all read — once the repair work is applied, unless that page
        awaits a pending write itself (its content before the next work is then unknown: 0)."""
        pg = self.pages
        entry = self.writes.writes.get(int(pg.device_page[d]))
        if entry is None:
            return 0
        from_payload, source, cols = entry
        if from_payload:
            return min(columns, cols)
        def same(s: int, gen: int) -> bool:
            return bool(pg.live[s]) and pg.generation[s] == gen

        s, gen = int(pg.fill_src[d]), int(pg.fill_src_gen[d])
        while same(s, gen) and pg.device_page[s] != source and pending[s] and pg.fill_src[s] >= 0:
            s, gen = int(pg.fill_src[s]), int(pg.fill_src_gen[s])
        if not same(s, gen) or pg.device_page[s] != source or pending[s]:
            return 0
        return min(columns, cols, int(ok[s]))

    # -- checks ---------------------------------------------------------------------------------------------------
    def audit_invariants(self, quarantined: np.ndarray | None = None) -> None:
        """Raise :class:`InvariantError` on any inconsistency of this pool's state.

        ``quarantined``: active rows whose content a resync found lost; their block-table rows hold
        sentinels instead of their membership."""
        name = self.kind.value
        pool, pg, sp = self.pool, self.pages, self.spaces
        pool.audit_invariants()
        live_sp = np.flatnonzero(sp.live)
        counts = np.zeros(pg.capacity, np.int64)
        active_counts = np.zeros(pg.capacity, np.int64)
        for s in live_sp.tolist():
            n = int(sp.n_blocks[s])
            m = sp.membership[s]
            if (m[:n] < 0).any() or (m[n:] != -1).any():
                raise InvariantError(f"pool {name}: space {s} membership has holes or trailing entries")
            if not pg.live[m[:n]].all():
                raise InvariantError(f"pool {name}: space {s} references a dead page")
            if np.unique(m[:n]).size != n:
                raise InvariantError(f"pool {name}: space {s} maps one page twice")
            if sp.mapped[s] != n * PAGE_SIZE or not sp.protected[s] <= sp.committed[s] <= sp.mapped[s]:
                raise InvariantError(f"pool {name}: space {s} frontiers are inconsistent")
            counts[m[:n]] += 1
            if sp.active[s]:
                active_counts[m[:n]] += 1
                if s >= self.rows:
                    raise InvariantError(f"pool {name}: active space in inactive slot {s}")
                if pool.reservation(s) != sp.ent_pages[s] - n or n > sp.ent_pages[s]:
                    raise InvariantError(
                        f"pool {name}: row {s} reservation {pool.reservation(s)} != entitlement "
                        f"{int(sp.ent_pages[s])} - mapped {n}"
                    )
                pb = int(sp.protected[s]) // PAGE_SIZE
                head, tail = m[:pb], m[pb:n]
                if (pg.writer[head] == s).any():
                    raise InvariantError(f"pool {name}: row {s} writes a protected page")
                if (pg.writer[tail] != s).any() or (pg.writer_block[tail] != np.arange(pb, n)).any():
                    raise InvariantError(f"pool {name}: row {s} does not own its writable pages")
                expect = np.full(self.logical_pages, SENTINEL_PAGE, np.int32)
                if quarantined is None or not quarantined[s]:
                    expect[:n] = pg.device_page[m[:n]]
                if not np.array_equal(self.table.entries[s], expect):
                    raise InvariantError(f"pool {name}: block-table row {s} does not mirror its membership")
            else:
                if s < self.rows:
                    raise InvariantError(f"pool {name}: inactive space holds row slot {s}")
                if n != -(-int(sp.committed[s]) // PAGE_SIZE):
                    raise InvariantError(f"pool {name}: checkpoint {s} holds pages beyond its frontier")
                cols = self.page_committed(m[:n])
                expect_cols = np.clip(int(sp.committed[s]) - np.arange(n) * PAGE_SIZE, 0, PAGE_SIZE)
                if not np.array_equal(cols, expect_cols) or (pg.protected[m[:n]] < expect_cols).any():
                    raise InvariantError(f"pool {name}: checkpoint {s} pages lost committed or protected columns")
        for r in range(self.rows):
            if not sp.active[r]:
                if sp.live[r] or pool.reservation(r) != 0 or (self.table.entries[r] != SENTINEL_PAGE).any():
                    raise InvariantError(f"pool {name}: idle row {r} holds state")
        live = pg.live
        if not np.array_equal(counts[live], pg.refs[live]) or not np.array_equal(active_counts[live], pg.active_refs[live]):
            raise InvariantError(f"pool {name}: page reference counts disagree with memberships")
        if (counts[~live] != 0).any():
            raise InvariantError(f"pool {name}: a dead page is referenced")
        on_device = live & (pg.device_page >= 0)
        dev = pg.device_page[on_device]
        if np.unique(dev).size != dev.size or dev.size != pool.allocated:
            raise InvariantError(f"pool {name}: every allocated page ID must back exactly one live page")
        pool.check_leases(dev, pg.device_gen[on_device])
        host_only = np.flatnonzero(live & (pg.device_page < 0))
        if host_only.size:
            if self.host_replicas is None:
                raise InvariantError(f"pool {name}: live pages {host_only.tolist()} have no Device replica")
            if (pg.active_refs[host_only] != 0).any() or (pg.writer[host_only] >= 0).any():
                raise InvariantError(f"pool {name}: a Host-only page is referenced by an active address space")
            if not pg.host_valid(host_only, self.page_committed(host_only)).all():
                raise InvariantError(f"pool {name}: a Host-only page has no valid Host replica (content lost)")
        if (pg.host_page[live & (pg.writer >= 0)] >= 0).any():
            raise InvariantError(f"pool {name}: a page with a writer has a Host replica")
        if (pg.host_page[~live] >= 0).any() or (pg.device_page[~live] >= 0).any():
            raise InvariantError(f"pool {name}: a free descriptor holds a replica")
        if self.host_replicas is not None:
            self.host_replicas.audit_invariants()
        shared = live & (pg.refs > 1)
        if (self.page_committed(np.flatnonzero(shared)) != PAGE_SIZE).any() or (pg.writer[shared] >= 0).any():
            raise InvariantError(f"pool {name}: a shared page is partial or has a writer")
        writers = np.flatnonzero(live & (pg.writer >= 0))
        if (pg.refs[writers] != 1).any() or (pg.protected[writers] != 0).any():
            raise InvariantError(f"pool {name}: a written page is shared or protected")
        if pg.num_live != int(live.sum()):
            raise InvariantError(f"pool {name}: descriptor free list disagrees with live flags")

    def snapshot(self) -> dict:
        return {
            "pool": self.pool.snapshot(),
            "pages": self.pages.snapshot(),
            "spaces": self.spaces.snapshot(),
            "table": self.table.snapshot(),
            "writes": self.writes.snapshot(),
            "history": self.history.snapshot(),
        }
