"""The data the store hands the device: round works, offload requests and payloads, sync status.

Plain numpy dataclasses (a leaf of the package: it imports no JAX and nothing of the store or the
device layer).  The store builds them; the device layer (:mod:`ninfer_kv.device`) registers them
as pytrees and applies them.

Per pool a work holds

* ``tables``: ``int32 (3, U)`` block-table updates ``(row, block, page)``; padding rows are ``C``
  (dropped by the scatter);
* ``copies``: ``int32 (3, K)`` page writes from device pages ``(src, dst, columns)``: columns
  ``[0, columns)`` of ``src`` onto ``dst`` (partial-tail COW);
* ``restores``: ``int32 (2, R)`` page writes from the Host payload ``(dst, columns)`` and
  ``payload``: per plane ``(R, layers, H, P, X)`` unsigned words of the plane's width (the Host
  replica's bytes, so any payload — NaN bit patterns included — lands byte-exactly).

Padding entries have ``columns == 0`` and destination ``N`` (out of range: dropped).  Every
destination is distinct within a work and every source reads the content the page had *before*
the work: :class:`PageWrites` resolves a write whose source was itself written earlier in the same
work to that earlier write's source, and a later write to a destination replaces an earlier one
(the earlier content of a freed-and-reused page is dead), so one parallel gather-then-scatter
equals the sequential history.  Bucketed shapes (``U``, ``K``, ``R`` from fixed ladders, ``0``
included, where the work is skipped at trace time) bound the compilations of any step that
applies a work: one per bucket combination.

Order: ``work.serial`` is the number of works the store handed out before this one and
``work.store`` the store's identity; a state applies a work only in order and from its own store
(:func:`~ninfer_kv.device.work.apply_work`), and is poisoned otherwise (:data:`POISONED`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .errors import WorkOrderError

__all__ = [
    "PoolWork",
    "RoundWork",
    "PendingWork",
    "GatherRequest",
    "OffloadPayload",
    "ShardedRoundWork",
    "stack_works",
    "SyncStatus",
    "POISONED",
    "BLANK",
]

POISONED = -1
"""``KVDeviceState.serial`` after a work was applied out of order (sticky until a resync)."""

BLANK = -2
"""``KVDeviceState.fault[1]`` of a state allocated after works were taken: it holds no content."""

_HEALTHY = (-1, -1, -1)


class SyncStatus(NamedTuple):
    """Where a state stands against its store's works (one host read of :meth:`KVDeviceState.sync_status`).

    Attributes:
      applied: works applied in order (before the first out-of-order one when ``poisoned``).
      poisoned: a work arrived out of order or from another store (or the state was allocated
        blank); the state drops every op until it is resynced.
      offending: the serial of the first such work, ``BLANK`` for a blank state, ``None`` while
        healthy.
      owner: the identity of the store the state belongs to (0: not bound yet).
      offending_store: the identity of the store the first such work came from (``None`` while
        healthy or blank).
    """

    applied: int
    poisoned: bool
    offending: int | None
    owner: int = 0
    offending_store: int | None = None


@dataclasses.dataclass(frozen=True)
class PoolWork:
    """One pool's part of a :class:`RoundWork` (see the module docstring for the arrays).

    ``pad_row`` (``C``) and ``pad_page`` (``N``) are the out-of-range padding targets.  As a pytree
    its leaves are the non-empty arrays only (an empty bucket is part of the static structure), so
    a decode round's work is its table updates and nothing else to transfer.
    """

    tables: np.ndarray
    copies: np.ndarray
    restores: np.ndarray
    payload: dict
    pad_row: int = 0
    pad_page: int = 0

    @property
    def empty(self) -> bool:
        """Whether the work changes nothing (no table entries, copies or restores)."""
        return not (self.tables.shape[1] or self.copies.shape[1] or self.restores.shape[1])

    def used(self) -> tuple[int, int, int]:
        """Entries that carry work (not padding): table updates, copies, restores."""
        return (
            int((self.tables[0] != self.pad_row).sum()),
            int((self.copies[2] > 0).sum()),
            int((self.restores[1] > 0).sum()),
        )

    def without_page_writes(self) -> "PoolWork":
        """The same work with its page writes (COW copies, Host restores) removed."""
        payload = {n: np.zeros((0,) + x.shape[1:], x.dtype) for n, x in self.payload.items()}
        return PoolWork(
            self.tables, np.zeros((3, 0), np.int32), np.zeros((2, 0), np.int32), payload, self.pad_row, self.pad_page
        )

    def pad_to(self, tables: int, copies: int, restores: int) -> "PoolWork":
        """The same work in larger buffers (padding entries do nothing)."""
        t, k, r = self.tables.shape[1], self.copies.shape[1], self.restores.shape[1]
        if t > tables or k > copies or r > restores:
            raise ValueError(f"a work of sizes ({t}, {k}, {r}) does not fit ({tables}, {copies}, {restores})")
        out_t = self.tables
        if tables > t:
            out_t = np.zeros((3, tables), np.int32)
            out_t[:, :t] = self.tables
            out_t[0, t:] = self.pad_row
        out_k = self.copies
        if copies > k:
            out_k = np.zeros((3, copies), np.int32)
            out_k[:, :k] = self.copies
            out_k[1, k:] = self.pad_page
        out_r, payload = self.restores, self.payload
        if restores > r:
            out_r = np.zeros((2, restores), np.int32)
            out_r[:, :r] = self.restores
            out_r[0, r:] = self.pad_page
            payload = {}
            for name, x in self.payload.items():
                y = np.zeros((restores,) + x.shape[1:], x.dtype)
                y[:r] = x
                payload[name] = y
        return PoolWork(out_t, out_k, out_r, payload, self.pad_row, self.pad_page)


@dataclasses.dataclass(frozen=True, init=False)
class RoundWork:
    """Everything the device must do before the next unit reads (one :meth:`KVStore.take_work`).

    ``RoundWork(serial, pools, store=0)``.

    Attributes:
      stamp: ``int32 (2,)`` ``(serial, store)``, read through :attr:`serial` and :attr:`store`
        (one small array, so a step that applies the work transfers one buffer for its order).
      pools: ``{PoolKind: PoolWork}``.
    """

    stamp: Any
    pools: dict

    def __init__(self, serial, pools: dict, store=0):
        object.__setattr__(self, "stamp", np.array([int(np.asarray(serial)), int(np.asarray(store))], np.int32))
        object.__setattr__(self, "pools", pools)

    @classmethod
    def from_stamp(cls, stamp, pools: dict) -> "RoundWork":
        """A work of an existing ``(serial, store)`` stamp of any array type (e.g. traced)."""
        work = object.__new__(cls)
        object.__setattr__(work, "stamp", stamp)
        object.__setattr__(work, "pools", pools)
        return work

    @property
    def serial(self):
        """``int32 ()`` works the store handed out before this one."""
        return self.stamp[0]

    @property
    def store(self):
        """``int32 ()`` the identity of the store that took it (``KVStore.identity``; 0 for a work built
        by hand, which any state accepts); a state bound to another store is poisoned by it."""
        return self.stamp[1]

    @property
    def empty(self) -> bool:
        """Nothing for the device to do (the serial must still be applied: works are never skipped)."""
        return all(p.empty for p in self.pools.values())

    def counts(self) -> dict:
        """``{PoolKind: (table updates, copies, restores)}`` in bucketed (padded) sizes."""
        return {k: (p.tables.shape[1], p.copies.shape[1], p.restores.shape[1]) for k, p in self.pools.items()}

    def fits(self, tables: int, copies: int = 0, restores: int = 0) -> bool:
        """Whether every pool's part fits buffers of these sizes (see :meth:`pad_to`)."""
        return all(t <= tables and k <= copies and r <= restores for t, k, r in self.counts().values())

    def without_page_writes(self) -> "RoundWork":
        """The table updates and the serial of this work, its page writes removed."""
        return RoundWork(self.serial, {k: p.without_page_writes() for k, p in self.pools.items()}, self.store)

    def pad_to(self, tables: int, copies: int = 0, restores: int = 0) -> "RoundWork":
        """The same work with every pool's buffers padded to fixed sizes, so a step that applies
        works has one signature: a caller takes the work, applies an oversized one alone
        (:func:`apply_work_jit`) and passes the next (empty) take padded into its step."""
        return RoundWork(
            self.serial, {k: p.pad_to(tables, copies, restores) for k, p in self.pools.items()}, self.store
        )


class PendingWork(NamedTuple):
    """What one pool's part of the next take holds: distinct block-table entries, COW copies and
    Host restores that carry work (:meth:`KVStore.pending_work`; the take pads each to its bucket)."""

    tables: int
    copies: int
    restores: int

    @property
    def empty(self) -> bool:
        """Nothing is pending."""
        return not (self.tables or self.copies or self.restores)


@dataclasses.dataclass(frozen=True)
class GatherRequest:
    """What an offload plan asks :func:`gather_pages` for (``OffloadPlan.request``).

    Attributes:
      pages: ``{PoolKind: int32 (B,)}`` Device pages to gather, in logical order (padded).
      store: ``int32 ()`` the identity of the store that made the plan.
      token: ``int32 ()`` the plan's number in that store.
    """

    pages: dict
    store: np.ndarray
    token: np.ndarray


@dataclasses.dataclass(frozen=True)
class OffloadPayload:
    """The gathered payload of one offload plan, naming what it was gathered for.

    Attributes:
      store, token: the plan's store identity and number (from its :class:`GatherRequest`).
      serial: ``int32 ()`` the applied-work serial of the state it was gathered from.
      pages: ``{PoolKind: int32 (B,)}`` the Device pages gathered.
      planes: ``{PoolKind: {plane: words (B, layers, H, P, X)}}`` their bytes as unsigned words.
    """

    store: Any
    token: Any
    serial: Any
    pages: dict
    planes: dict


@dataclasses.dataclass(frozen=True)
class ShardedRoundWork:
    """Every data shard's :class:`RoundWork` of one take, stacked on a leading shard axis.

    Per pool a :class:`PoolWork` whose arrays are ``tables (D, 3, U)``, ``copies (D, 3, K)``,
    ``restores (D, 2, R)`` and ``payload[plane] (D, R, layers, H, P, X)`` (each shard's work padded
    to the largest shard's buckets; padding does nothing).  ``serial`` and ``store`` (the sharded
    store's identity, which every shard's work carries) are shared: every take covers every shard.
    """

    serial: Any
    pools: dict
    store: Any = dataclasses.field(default_factory=lambda: np.asarray(0, np.int32))

    def shard(self, d: int) -> RoundWork:
        """Data shard ``d``'s part as a plain :class:`RoundWork` (host arrays)."""
        pools = {}
        for kind, pw in self.pools.items():
            pools[kind] = PoolWork(
                np.asarray(pw.tables[d]),
                np.asarray(pw.copies[d]),
                np.asarray(pw.restores[d]),
                {n: np.asarray(x[d]) for n, x in pw.payload.items()},
                pw.pad_row,
                pw.pad_page,
            )
        return RoundWork(np.asarray(self.serial), pools, np.asarray(self.store))

    def counts(self) -> dict:
        """``{PoolKind: (table updates, copies, restores)}`` per shard, in bucketed sizes."""
        return {k: (p.tables.shape[-1], p.copies.shape[-1], p.restores.shape[-1]) for k, p in self.pools.items()}

    def pad_to(self, tables: int, copies: int = 0, restores: int = 0) -> "ShardedRoundWork":
        """Every shard's work padded to fixed sizes (one signature for a step that applies works)."""
        d = next(iter(self.pools.values())).tables.shape[0]
        return stack_works([self.shard(i).pad_to(tables, copies, restores) for i in range(d)])

    def fits(self, tables: int, copies: int = 0, restores: int = 0) -> bool:
        """Whether every shard's part fits buffers of these sizes (see :meth:`pad_to`)."""
        return all(t <= tables and k <= copies and r <= restores for t, k, r in self.counts().values())

    def leaf_specs(self, kv_mesh) -> list:
        """Partition specs of this work's leaves, in ``jax.tree_util.tree_flatten`` order
        (:meth:`KVMesh.work_specs <ninfer_kv.device.mesh.KVMesh.work_specs>`)."""
        return kv_mesh.work_specs(self)

    def device_put(self, kv_mesh) -> "ShardedRoundWork":
        """The work as global ``jax.Array`` s on the mesh, each device holding only its shard's part
        (:meth:`KVMesh.put_work <ninfer_kv.device.mesh.KVMesh.put_work>`)."""
        return kv_mesh.put_work(self)


def stack_works(works: list[RoundWork]) -> ShardedRoundWork:
    """Stack per-shard works (same pools, serial and store) into one :class:`ShardedRoundWork`."""
    serials = {int(np.asarray(w.serial)) for w in works}
    if len(serials) != 1:
        raise WorkOrderError(f"the shards' works have different serials {sorted(serials)}")
    stores = {int(np.asarray(w.store)) for w in works}
    if len(stores) != 1:
        raise WorkOrderError(f"the shards' works come from different stores {sorted(stores)}")
    pools = {}
    for kind in works[0].pools:
        parts = [w.pools[kind] for w in works]
        t = max(p.tables.shape[1] for p in parts)
        k = max(p.copies.shape[1] for p in parts)
        r = max(p.restores.shape[1] for p in parts)
        parts = [p.pad_to(t, k, r) for p in parts]
        pools[kind] = PoolWork(
            np.stack([p.tables for p in parts]),
            np.stack([p.copies for p in parts]),
            np.stack([p.restores for p in parts]),
            {n: np.stack([p.payload[n] for p in parts]) for n in parts[0].payload},
            parts[0].pad_row,
            parts[0].pad_page,
        )
    return ShardedRoundWork(np.asarray(serials.pop(), np.int32), pools, np.asarray(stores.pop(), np.int32))


# -- the store ----------------------------------------------------------------------------------------
