"""Inspection: the read-only views of a store — pools, layouts, rows, bundles, address spaces,
checkpoint info, occupancy, memory summaries, invariant checks and snapshots."""

from __future__ import annotations

import numpy as np

from ..schema.errors import InvariantError
from .summary import PoolOccupancy, StoreMemorySummary
from .address_space import KVAddressSpace
from .bundle import CheckpointHandle, CheckpointInfo, SequenceHandle, SequenceKVBundle
from .core import StoreCore

__all__ = ["InspectionVerbs"]


class InspectionVerbs:
    """Read-only views of :class:`~ninfer_kv.store.KVStore`."""

    _core: StoreCore

    def host_block_table(self, pool="main") -> np.ndarray:
        """A copy of the store's block tables of ``pool`` (includes entries not yet taken)."""
        return self._core.runtime(pool).table.entries.copy()

    def occupancy(self, pool="main") -> PoolOccupancy:
        """``pool``'s :class:`PoolOccupancy`: capacity, allocated / reserved / available pages, logical, shared and Host pages, bytes."""
        rt = self._core.runtime(pool)
        pg, sp = rt.pages, rt.spaces
        live = pg.live
        inactive = sp.live & ~sp.active
        return PoolOccupancy(
            pool=rt.kind.value,
            capacity=rt.pool.capacity,
            allocated=rt.pool.allocated,
            reserved=rt.pool.reserved,
            available=rt.pool.available,
            logical_pages=int(live.sum()),
            shared_pages=int((live & (pg.refs > 1)).sum()),
            mapped_blocks=int(sp.n_blocks[sp.live].sum()),
            active_spaces=int(sp.active.sum()),
            retained_checkpoints=int(inactive.sum()),
            page_bytes=rt.layout.page_bytes,
            plane_bytes=rt.layout.buffer_bytes(rt.pool.capacity),
            table_bytes=rt.rows * rt.logical_pages * 4,
            host_pages=int((live & (pg.host_page >= 0)).sum()),
            host_only_pages=int((live & (pg.device_page < 0)).sum()),
        )

    def memory_summary(self) -> StoreMemorySummary:
        """A :class:`StoreMemorySummary` of every pool, the Host arena and the transfer counters (``.table()`` renders it)."""
        return StoreMemorySummary(
            pools={k: self.occupancy(k) for k in self._core.runtimes},
            active_sequences=int(self._core.rows.active().size),
            retained_checkpoints=len(self._core.checkpoints()),
            host=self._core.host_occupancy(),
            offloaded_pages=self._core.stats.offloaded_pages,
            restored_pages=self._core.stats.restored_pages,
            ring_bytes=self._core.pool_set.ring_bytes,
        )

    def audit_invariants(self) -> None:
        """Raise :class:`InvariantError` on any inconsistency (every pool, rows and handles)."""
        for rt in self._core.runtimes.values():
            rt.audit_invariants(self._core.rows.quarantined)
        active = self._core.rows.active()
        for kind, rt in self._core.runtimes.items():
            if not np.array_equal(np.flatnonzero(rt.spaces.active[: self._core.max_concurrency]), active):
                raise InvariantError(f"pool {kind.value}: active rows disagree with leased rows")
        self._core.rows.audit_invariants(InvariantError)
        quarantined = np.zeros_like(self._core.rows.quarantined)
        for h in self._core.sequences():
            rec = self._core.registry.get(h)
            if self._core.rows.owner[rec.row] != h.id:
                raise InvariantError(f"sequence {h.id} does not own its row")
            quarantined[rec.row] = rec.lost is not None
        if not np.array_equal(quarantined, self._core.rows.quarantined):
            raise InvariantError("quarantined rows disagree with the sequences a resync found lost")
        if self._core.host is not None:
            self._core.host.audit_invariants()

    def snapshot(self) -> dict:
        """A comparable deep copy of every piece of semantic state (for tests and debugging).

        It describes state, not counters: a verb that failed and rolled back (or was refused) leaves
        a store whose snapshot equals the one taken before it.  The Host transfer counters
        (:attr:`stats`) and the arena's handle bookkeeping are not part of it."""
        return {
            "pools": {k.value: rt.snapshot() for k, rt in self._core.runtimes.items()},
            "rows": self._core.rows.snapshot(),
            "work_serial": self._core.work_serial,
            "registry": self._core.registry.snapshot(),
            "host": None if self._core.host is None else self._core.host.snapshot(),
        }

    def pool(self, pool="main"):
        """The :class:`DevicePagePool` of ``pool`` (a ``PoolKind`` or its name)."""
        return self._core.runtime(pool).pool

    def layout(self, pool="main"):
        """The :class:`PagedKVStorageLayout` of ``pool``."""
        return self._core.runtime(pool).layout

    def row(self, handle: SequenceHandle) -> int:
        """The execution row (block-table row in every pool) of an active sequence."""
        return self._core.sequence_record(handle).row

    def committed_frontiers(self, rows, pool="main") -> np.ndarray:
        """Each execution row's committed frontier in ``pool`` (``int64``); ``rows`` are checked as
        :meth:`~ninfer_kv.store.row_verbs.RowVerbs.check_rows` checks them.  Changes nothing."""
        rows = self._core.rows.check(rows)
        return self._core.runtime(pool).spaces.committed[rows].astype(np.int64)

    def bundle(self, handle: SequenceHandle) -> SequenceKVBundle:
        """The :class:`SequenceKVBundle` of an active sequence: its row and its address space in every pool."""
        rec = self._core.sequence_record(handle)
        spaces = {
            k: KVAddressSpace(rt, rec.row, int(rt.spaces.generation[rec.row])) for k, rt in self._core.runtimes.items()
        }
        return SequenceKVBundle(handle, rec.row, spaces)

    def address_space(self, handle, pool="main") -> KVAddressSpace:
        """The address space of a sequence or checkpoint in ``pool``."""
        rec = self._core.registry.get(handle)
        rt = self._core.runtime(pool)
        slot = rec.slots[rt.kind]
        return KVAddressSpace(rt, slot, int(rt.spaces.generation[slot]))

    def checkpoint(self, handle: CheckpointHandle) -> CheckpointInfo:
        """What a retained checkpoint holds: :class:`CheckpointInfo` (frontiers, state image, reusability, placement)."""
        rec = self._core.checkpoint_record(handle)
        frontiers = {k: int(rt.spaces.committed[rec.slots[k]]) for k, rt in self._core.runtimes.items()}
        spaces = {
            k: KVAddressSpace(rt, rec.slots[k], int(rt.spaces.generation[rec.slots[k]]))
            for k, rt in self._core.runtimes.items()
        }
        placement, counts = self._core.placement(rec)
        return CheckpointInfo(handle, frontiers, rec.state_image, self._core.reusable(rec), spaces, placement, counts)

    def lost(self) -> dict:
        """``{handle: {PoolKind: intact frontier}}`` of every sequence and checkpoint quarantined by a
        resync and not yet released or returned to service."""
        out = {}
        for h in self._core.sequences() + self._core.checkpoints():
            rec = self._core.registry.get(h)
            if rec.lost is not None:
                out[h] = dict(rec.lost)
        return out

    def active_rows(self) -> np.ndarray:
        """Execution rows leased to active sequences, ascending (``int64 (n,)``)."""
        return self._core.rows.active()

    def describe(self) -> str:
        """One line: the plan's numbers, the pools' capacities, active sequences and checkpoints."""
        pools = ", ".join(f"{k.value}:{rt.pool.capacity}" for k, rt in self._core.runtimes.items())
        host = "" if self._core.host is None else f", host_arena={self._core.host.arena.capacity}"
        return (
            f"KVStore(S={self._core.max_context}, C={self._core.max_concurrency}, L={self._core.logical_pages}, pools=[{pools}], "
            f"active={int(self._core.rows.active().size)}, checkpoints={len(self._core.checkpoints())}{host})"
        )
