"""Occupancy and memory summaries of a KV store.

Device occupancy counts each physical page once: leases (``allocated``) plus reservations.
Logical aliases — one page referenced by several address spaces — are reported separately
(``aliased_blocks``) and never billed twice.  With a Host tier, Host pages are billed in the Host
arena by packed bytes and extent geometry (:class:`~ninfer_kv.store.summary.HostOccupancy`);
they never count as Device occupancy.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

__all__ = ["PoolOccupancy", "StoreMemorySummary", "HostTransferStats", "HostPoolOccupancy", "HostOccupancy"]



def _read(part: str, name: str, doc: str) -> property:
    """A read-only property returning ``self.<part>.<name>``, documented by ``doc``."""

    def get(self):
        return getattr(getattr(self, part), name)

    get.__doc__ = doc
    return property(get)

@dataclasses.dataclass(frozen=True)
class PoolOccupancy:
    """One pool at one instant.

    Attributes:
      pool: pool name (``main``, ``mtp``, ``draft_full``).
      capacity: physical pages N; ``allocated + reserved + available == capacity``.
      allocated: pages held by Device leases.
      reserved: pages promised to active entitlements but not materialized.
      available: pages free for new reservations.
      logical_pages: live logical page descriptors.
      shared_pages: logical pages referenced by more than one address space.
      mapped_blocks: membership entries over every address space.
      active_spaces: active address spaces (each holds an execution row).
      retained_checkpoints: inactive address spaces (retained checkpoints).
      page_bytes: bytes of one page across every plane and layer.
      plane_bytes: bytes of the pool's device planes.
      table_bytes: bytes of the pool's block-table matrix.
      host_pages: live logical pages holding a Host replica (0 without a Host tier).
      host_only_pages: live logical pages whose only replica is on Host (no Device lease).
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
    host_pages: int = 0
    host_only_pages: int = 0

    @property
    def aliased_blocks(self) -> int:
        """Membership entries that reuse a page another address space also maps."""
        return self.mapped_blocks - self.logical_pages

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pool's allocated pages."""
        return self.allocated * self.page_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pool's reserved (entitled, not yet allocated) pages."""
        return self.reserved * self.page_bytes

    @property
    def available_bytes(self) -> int:
        """Bytes of the pool's pages neither allocated nor reserved."""
        return self.available * self.page_bytes

    def to_json(self) -> dict:
        """This summary as plain JSON types (dicts, lists, numbers, strings)."""
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
    """Every pool of a store, plus sequence and checkpoint counts and the Host tier.

    ``host`` is the :class:`HostOccupancy` (``None`` without a Host
    tier); ``offloaded_pages`` / ``restored_pages`` are the Host transfer counters; ``ring_bytes``
    the bytes of the window rings of sliding-window layers (0 without; fixed per row).
    """

    pools: dict
    active_sequences: int
    retained_checkpoints: int
    host: object = None
    offloaded_pages: int = 0
    restored_pages: int = 0
    ring_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        """Bytes of every pool's planes and block tables, and of the window rings."""
        return sum(p.plane_bytes + p.table_bytes for p in self.pools.values()) + self.ring_bytes

    def to_json(self) -> dict:
        """This summary as plain JSON types (dicts, lists, numbers, strings)."""
        return {
            "pools": {getattr(k, "value", k): p.to_json() for k, p in self.pools.items()},
            "active_sequences": self.active_sequences,
            "retained_checkpoints": self.retained_checkpoints,
            "device_bytes": self.device_bytes,
            "host": None if self.host is None else self.host.to_json(),
            "offloaded_pages": self.offloaded_pages,
            "restored_pages": self.restored_pages,
            "ring_bytes": self.ring_bytes,
        }

    def table(self) -> str:
        """A small fixed-width text table."""
        head = (
            f"{'pool':<11}{'capacity':>9}{'alloc':>8}{'resv':>8}{'avail':>8}{'pages':>8}{'shared':>8}{'ckpts':>7}"
            f"{'host':>7}{'h-only':>8}"
        )
        lines = [head]
        for p in self.pools.values():
            lines.append(
                f"{p.pool:<11}{p.capacity:>9}{p.allocated:>8}{p.reserved:>8}{p.available:>8}"
                f"{p.logical_pages:>8}{p.shared_pages:>8}{p.retained_checkpoints:>7}{p.host_pages:>7}"
                f"{p.host_only_pages:>8}"
            )
        if self.ring_bytes:
            lines.append(f"window rings {self.ring_bytes} B (fixed per execution row)")
        if self.host is not None:
            h = self.host
            lines.append(
                f"host arena {h.capacity} B: used {h.used_bytes} B in {h.extent_count} extents, free {h.free_bytes} B "
                f"(largest {h.largest_free_extent} B); offloaded {self.offloaded_pages} pages, restored "
                f"{self.restored_pages} pages"
            )
        return "\n".join(lines)


@dataclasses.dataclass
class HostTransferStats:
    """Counters of the Host tier (published transfers only; a rolled-back restore is not counted).

    Attributes:
      offloaded_pages / offloaded_bytes: Host replicas published (Device -> Host).
      restored_pages / restored_bytes: Device replicas published from Host (verb or activation).
      dropped_device_pages: Device leases released by ``drop_device_replica``.
      released_host_pages: Host replicas released by ``release_host_replica`` / ``drop_host=True``.
    """

    offloaded_pages: int = 0
    offloaded_bytes: int = 0
    restored_pages: int = 0
    restored_bytes: int = 0
    dropped_device_pages: int = 0
    released_host_pages: int = 0

    def copy(self) -> "HostTransferStats":
        """An independent copy of the counters."""
        return dataclasses.replace(self)

    def to_json(self) -> dict:
        """This summary as plain JSON types (dicts, lists, numbers, strings)."""
        return dict(vars(self))


@dataclasses.dataclass(frozen=True)
class HostPoolOccupancy:
    """One pool's share of the Host arena.

    Attributes:
      pool: pool name (the tag of its extents).
      stride: bytes of one Host page of this pool (its ``HostKVPageLayout.stride`` == PageBytes).
      host_pages: live logical pages holding a Host replica.
      host_only_pages: live logical pages whose only replica is on Host.
      extents: live extents of this pool.
      extent_pages: page slots of those extents (``>= host_pages``: an extent is freed only with its
        last page, so slots of pages released earlier stay billed until then).
      used_bytes: packed bytes of those extents (``extent_pages * stride``).
    """

    pool: str
    stride: int
    host_pages: int
    host_only_pages: int
    extents: int
    extent_pages: int
    used_bytes: int

    def to_json(self) -> dict:
        """This summary as plain JSON types (dicts, lists, numbers, strings)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HostOccupancy:
    """The Host arena (byte-exact extent occupancy), per-pool Host pages and the transfer counters."""

    arena: object  # ninfer_kv.host.ExtentOccupancy
    staging: str  # the arena's requested staging (ninfer_kv.host.arena.STAGING_MODES)
    pools: Mapping[str, HostPoolOccupancy]
    stats: HostTransferStats

    capacity = _read("arena", "capacity", "Bytes of the arena buffer.")
    used_bytes = _read("arena", "used_bytes", "Packed bytes of live extents.")
    padding_bytes = _read("arena", "padding_bytes", "Alignment padding of live extents, in bytes.")
    free_bytes = _read("arena", "free_bytes", "Bytes not held by any extent.")
    largest_free_extent = _read("arena", "largest_free_extent", "Bytes of the largest free range.")
    extent_count = _read("arena", "extent_count", "Live extents.")
    free_extent_count = _read("arena", "free_extent_count", "Free ranges.")
    fragmentation = _read("arena", "fragmentation", "``1 - largest_free_extent / free_bytes`` (0 when nothing is free).")
    offloaded_pages = _read("stats", "offloaded_pages", "Pages copied Device -> Host so far.")
    restored_pages = _read("stats", "restored_pages", "Pages copied Host -> Device so far.")

    @property
    def host_pages(self) -> int:
        """Host pages held over every pool."""
        return sum(p.host_pages for p in self.pools.values())

    def to_json(self) -> dict:
        """This summary as plain JSON types (dicts, lists, numbers, strings)."""
        return {
            "arena": self.arena.to_json(),
            "staging": self.staging,
            "pools": {getattr(k, "value", k): p.to_json() for k, p in self.pools.items()},
            "stats": self.stats.to_json(),
        }
