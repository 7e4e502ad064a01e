"""Occupancy and memory summaries of a KV store.

Device occupancy counts each physical page group once: leases (``allocated``) plus reservations.
Logical aliases — one page referenced by several address spaces — are reported separately
(``aliased_blocks``) and never billed twice.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PoolOccupancy", "StoreMemorySummary"]


@dataclasses.dataclass(frozen=True)
class PoolOccupancy:
    """One pool at one instant.

    Attributes:
      pool: pool name (``main``, ``mtp``, ``draft_full``).
      capacity: physical page groups N; ``allocated + reserved + available == capacity``.
      allocated: page groups held by Device leases.
      reserved: page groups promised to active entitlements but not materialized.
      available: page groups free for new reservations.
      logical_pages: live logical page descriptors.
      shared_pages: logical pages referenced by more than one address space.
      mapped_blocks: membership entries over every address space.
      active_spaces: active address spaces (each holds an execution row).
      retained_checkpoints: inactive address spaces (retained checkpoints).
      page_bytes: bytes of one page group across every plane and layer.
      plane_bytes: bytes of the pool's device planes.
      table_bytes: bytes of the pool's block-table matrix.
    """

    pool: str
    capacity: int
    allocated: int
    reserved: int
    available: int
    logical_pages: int
    shared_pages: int
    mapped_blocks: int
    active_spaces: int
    retained_checkpoints: int
    page_bytes: int
    plane_bytes: int
    table_bytes: int

    @property
    def aliased_blocks(self) -> int:
        """Membership entries that reuse a page another address space also maps."""
        return self.mapped_blocks - self.logical_pages

    @property
    def allocated_bytes(self) -> int:
        return self.allocated * self.page_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.reserved * self.page_bytes

    @property
    def available_bytes(self) -> int:
        return self.available * self.page_bytes

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            aliased_blocks=self.aliased_blocks,
            allocated_bytes=self.allocated_bytes,
            reserved_bytes=self.reserved_bytes,
            available_bytes=self.available_bytes,
        )
        return out


@dataclasses.dataclass(frozen=True)
class StoreMemorySummary:
    """Every pool of a store, plus sequence and checkpoint counts."""

    pools: dict
    active_sequences: int
    retained_checkpoints: int

    @property
    def device_bytes(self) -> int:
        """Bytes of every pool's planes and block tables."""
        return sum(p.plane_bytes + p.table_bytes for p in self.pools.values())

    def to_json(self) -> dict:
        return {
            "pools": {k: p.to_json() for k, p in self.pools.items()},
            "active_sequences": self.active_sequences,
            "retained_checkpoints": self.retained_checkpoints,
            "device_bytes": self.device_bytes,
        }

    def table(self) -> str:
        """A small fixed-width text table."""
        head = f"{'pool':<11}{'capacity':>9}{'alloc':>8}{'resv':>8}{'avail':>8}{'pages':>8}{'shared':>8}{'ckpts':>7}"
        lines = [head]
        for p in self.pools.values():
            lines.append(
                f"{p.pool:<11}{p.capacity:>9}{p.allocated:>8}{p.reserved:>8}{p.available:>8}"
                f"{p.logical_pages:>8}{p.shared_pages:>8}{p.retained_checkpoints:>7}"
            )
        return "\n".join(lines)
