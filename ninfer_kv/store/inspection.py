"""Inspection: occupancy, memory summaries, invariant checks and snapshots of a store."""

from __future__ import annotations

import numpy as np

from .errors import InvariantError
from .summary import PoolOccupancy, StoreMemorySummary

__all__ = ["InspectionVerbs"]


class InspectionVerbs:
    """Read-only views of :class:`~ninfer_kv.store.KVStore`."""

    def host_block_table(self, pool="main") -> np.ndarray:
        """A copy of the host mirror of ``pool``'s block tables (includes entries not yet taken)."""
        return self._runtime(pool).table.host.copy()

    def occupancy(self, pool="main") -> PoolOccupancy:
        """``pool``'s :class:`PoolOccupancy`: capacity, allocated / reserved / available pages, logical, shared and Host pages, bytes."""
        rt = self._runtime(pool)
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
            pools={k: self.occupancy(k) for k in self._rt},
            active_sequences=int(self._rows.active().size),
            retained_checkpoints=len(self.checkpoints()),
            host=self.host_occupancy(),
            offloaded_pages=self.stats.offloaded_pages,
            restored_pages=self.stats.restored_pages,
        )

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` on any inconsistency (every pool, rows and handles)."""
        for rt in self._rt.values():
            rt.check_invariants(self._rows.quarantined)
        active = self._rows.active()
        for kind, rt in self._rt.items():
            if not np.array_equal(np.flatnonzero(rt.spaces.active[: self.max_concurrency]), active):
                raise InvariantError(f"pool {kind.value}: active rows disagree with leased rows")
        self._rows.check_invariants(InvariantError)
        quarantined = np.zeros_like(self._rows.quarantined)
        for h in self.sequences():
            rec = self._registry.get(h)
            if self._rows.owner[rec.row] != h.id:
                raise InvariantError(f"sequence {h.id} does not own its row")
            quarantined[rec.row] = rec.lost is not None
        if not np.array_equal(quarantined, self._rows.quarantined):
            raise InvariantError("quarantined rows disagree with the sequences a resync found lost")
        if self._host is not None:
            self._host.check_invariants()

    def snapshot(self) -> dict:
        """A comparable deep copy of every piece of semantic state (for tests and debugging).

        It describes state, not counters: a verb that failed and rolled back (or was refused) leaves
        a store whose snapshot equals the one taken before it.  The Host transfer counters
        (:attr:`stats`) and the arena's handle bookkeeping are not part of it."""
        return {
            "pools": {k.value: rt.snapshot() for k, rt in self._rt.items()},
            "rows": self._rows.snapshot(),
            "work_serial": self._work_serial,
            "registry": self._registry.snapshot(),
            "host": None if self._host is None else self._host.snapshot(),
        }

    def __repr__(self) -> str:
        pools = ", ".join(f"{k.value}:{rt.pool.capacity}" for k, rt in self._rt.items())
        host = "" if self._host is None else f", host_arena={self._host.arena.capacity}"
        return (
            f"KVStore(S={self.max_context}, C={self.max_concurrency}, L={self.logical_pages}, pools=[{pools}], "
            f"active={int(self._rows.active().size)}, checkpoints={len(self.checkpoints())}{host})"
        )
