"""The Host tier of one KV store: the HostTier composer, placement, and the replica rules.

One :class:`~ninfer_kv.host.HostKVArena` serves every pool of a store; each pool packs its pages
with its own :class:`~ninfer_kv.host.HostKVPageLayout` (its own stride) and tags its extents with
its name.  A page's Host replica is a *membership*: page ``i`` of one extent, plus the
``(epoch, coverage)`` verified when it was published.  Several pages share an extent (one extent
per pool per offload, pages in the checkpoint's logical order).

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

with the source and destination pinned during the copy (the logical pages carry a transaction pin,
so releasing the checkpoint, dropping or releasing a replica of a pinned page is refused) and the
destination invisible until published.  The tier is split along its two state machines, each in
its own module:

* :mod:`~ninfer_kv.store.host_offload` — :class:`~ninfer_kv.store.host_offload.HostOffload`,
  Device -> Host: plan (extents reserved, pages pinned) -> the caller's gather -> complete
  (copy, verify, publish) or cancel, with its handle :class:`~ninfer_kv.store.host_offload.OffloadPlan`;
* :mod:`~ninfer_kv.store.host_restore` — :class:`~ninfer_kv.store.host_restore.HostRestore`,
  Host -> Device (a checkpoint's restore, an activation's), Device replica drop and Host replica
  release;

over what they share: :mod:`~ninfer_kv.store.transfer_records` (one pool's part of a transfer, its
verification, the reports and fault stages) and each pool's Host replica table,
:class:`~ninfer_kv.store.pool_host_replicas.PoolHostReplicas` (extent memberships and the arena
bookkeeping).  Both change pool and page state only through the pool runtime's named transitions
(:class:`~ninfer_kv.store.runtime.PoolRuntime`).

The store's ``fault_injector(stage, pool)`` is called before each stage of a transfer:
:data:`~ninfer_kv.store.transfer_records.OFFLOAD_STAGES` and
:data:`~ninfer_kv.store.transfer_records.RESTORE_STAGES` (``*_reserve`` and ``*_publish`` store-wide with
pool ``None``, ``*_copy`` and ``*_verify`` per pool).  ``*_verify`` runs after the copy and before
publication: the copy's pins are held there.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..schema.errors import InvariantError
from ..host import HostKVArena
from ..schema.kinds import PoolKind
from .host_offload import HostOffload
from .host_restore import HostRestore
from .transfer_records import Fault
from .runtime import PoolRuntime
from .summary import HostOccupancy, HostTransferStats

__all__ = ["HostTier", "placement_of"]


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


class HostTier:
    """The Host replica tier of one store: the arena, each pool's Host replica table, the counters
    and the two state machines, :attr:`offload` (:class:`HostOffload`) and :attr:`restore`
    (:class:`HostRestore`).

    Args:
      arena: an empty :class:`HostKVArena` (the tier allocates and frees every extent in it).
      runtimes: the store's ``{PoolKind: PoolRuntime}``; each gets its
        :class:`~ninfer_kv.store.pool_host_replicas.PoolHostReplicas` over ``arena``.
      fault: ``fault(stage, pool_or_None)``, called before each transfer stage (the store's
        fault injector).
      identity: the store's identity, carried by every offload plan and checked on its payload.

    Every verb takes ``spaces = {PoolKind: inactive space slot}`` of one checkpoint, validates
    everything before it changes anything, and raises a clear error with the store unchanged.

    Invariant (:meth:`audit_invariants`): every live extent of the arena is either held by one
    pool's Host replica table or reserved by one offload plan in flight, never both.
    """

    def __init__(self, arena: HostKVArena, runtimes: Mapping[PoolKind, PoolRuntime], fault: Fault,
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
        for rt in self.rts.values():
            rt.attach_host(arena)
        self.stats = HostTransferStats()
        self.offload = HostOffload(arena, self.rts, self.stats, fault, identity)
        self.restore = HostRestore(self.rts, self.stats, fault)

    # -- inspection ---------------------------------------------------------------------------------------------
    def placement(self, spaces: Mapping[PoolKind, int]) -> tuple[str, dict]:
        dev, host = [], []
        for kind, space in spaces.items():
            rt = self.rts[kind]
            slots = rt.spaces.pages_of(space)
            dev.append(rt.pages.device_page[slots] >= 0)
            host.append(rt.host_replica_valid(slots))
        if not dev:
            return placement_of(np.zeros(0, bool), np.zeros(0, bool))
        return placement_of(np.concatenate(dev), np.concatenate(host))

    def occupancy(self) -> HostOccupancy:
        return HostOccupancy(
            arena=self.arena.occupancy(),
            staging=self.arena.staging,
            pools={kind: rt.host_replicas.occupancy() for kind, rt in self.rts.items()},
            stats=self.stats.copy(),
        )

    def audit_invariants(self) -> None:
        try:
            self.arena.audit_invariants()
        except AssertionError as exc:
            raise InvariantError(f"host arena: {exc}") from None
        held = sum(len(rt.host_replicas.users) for rt in self.rts.values())
        reserved = self.offload.reserved_extents()
        if held + reserved != self.arena.occupancy().extent_count:
            raise InvariantError(
                f"host arena holds {self.arena.occupancy().extent_count} extents but the pools reference {held} and "
                f"offload plans in flight reserve {reserved}"
            )
        self.offload.audit_invariants()

    def snapshot(self) -> dict:
        """What the tier holds: the arena's extents and free ranges, each pool's extent users and the
        plans in flight (by token) — state, not counters, so a rolled-back verb snapshots the same."""
        return {
            "arena": self.arena.describe(),
            "extents": {kind.value: rt.host_replicas.snapshot() for kind, rt in self.rts.items()},
            "in_flight": sorted(self.offload.in_flight),
        }
