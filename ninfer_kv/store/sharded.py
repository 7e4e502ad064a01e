"""ShardedKVStore: one KVStore (Python bookkeeping) per data shard of a device mesh.

Each data shard ``d`` of a :class:`~ninfer_kv.device.mesh.KVMesh` is its own pool set: a plain
:class:`~ninfer_kv.store.KVStore` built from the shard plan of a :class:`~ninfer_kv.planning.MeshKVPlan`,
with its own page-ID namespace ``0 .. N_local - 1``, free capacity, reservations and
``(C_local, L)`` block tables.  The sharded store only routes:

* a sequence lives on the data shard the caller names at :meth:`activate` (the store never picks);
  its **global row** is ``shard * C_local + local row``, which is also its row of the sharded
  block table ``(D * C_local, L)``;
* Move / Fork / COW happen inside the shard as in a single store; activating from a checkpoint on
  another shard is **refused** (:class:`CrossShardError`, nothing changes): the caller activates on
  the checkpoint's shard (``store.shard_of(checkpoint)``), or starts from the root;
* :meth:`take_work` takes every shard's round work at once and stacks it per shard
  (:class:`ShardedRoundWork`); :func:`~ninfer_kv.device.sharded_ops.sharded_apply_work` applies each
  shard's part on its own devices inside ``shard_map``.

Many processes.  The bookkeeping is deterministic Python: the same calls in the same order give the
same page IDs, rows and works on every process.  So every process runs the same program and keeps
the whole ``ShardedKVStore`` (all shards, a few KiB of numpy per shard); nothing is broadcast.
:meth:`ShardedRoundWork.device_put` builds each process's part of the global work arrays from its
own (identical) copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from ..planning import MeshKVPlan, PoolPlan
from ..schema.kinds import PoolKind
from .bundle import CheckpointHandle, SequenceHandle, next_store_serial
from .entitlement import RoundGrant
from ..schema.errors import KVStoreError, LifecycleError, RowError, WorkOrderError
from .repair import ResyncReport
from ..schema.round_work import OffloadPayload, ShardedRoundWork, stack_works
from .rows import as_index, as_index_vector
from .store import KVStore

__all__ = ["ShardedKVStore", "ShardedSequence", "ShardedCheckpoint", "CrossShardError"]


class CrossShardError(KVStoreError, ValueError):
    """An activation names a checkpoint that lives on another data shard (nothing changed)."""


@dataclasses.dataclass(frozen=True)
class ShardedSequence:
    """An active sequence of a :class:`ShardedKVStore`: its data shard and the shard's handle."""

    shard: int
    handle: SequenceHandle


@dataclasses.dataclass(frozen=True)
class ShardedCheckpoint:
    """A retained checkpoint of a :class:`ShardedKVStore`: its data shard and the shard's handle."""

    shard: int
    handle: CheckpointHandle



class ShardedKVStore:
    """The Python bookkeeping of a KV cache sharded over a ``data x model`` mesh.

    Args:
      plan: a :class:`MeshKVPlan` (``plan_kv_cache_mesh``).
      mesh: the :class:`~ninfer_kv.device.mesh.KVMesh` the state lives on (its spec must equal the plan's);
        ``None`` for bookkeeping only (no :func:`~ninfer_kv.device.allocation.allocate_state`).
      host_bytes: capacity of a Host arena *per data shard* (``None``: no Host tier).
      entitlement, requires_state_image, fault_injector: as :class:`KVStore` (every shard).
    """

    def __init__(self, plan: MeshKVPlan, mesh=None, *, entitlement=None, requires_state_image: bool = False,
                 fault_injector=None, host_bytes: int | None = None):
        if not isinstance(plan, MeshKVPlan):
            raise TypeError(f"plan must be a MeshKVPlan (plan_kv_cache_mesh), got {type(plan).__name__}")
        if mesh is not None and mesh.spec != plan.mesh:
            raise ValueError(f"the mesh {mesh.spec} differs from the plan's mesh {plan.mesh}")
        self.plan = plan
        self.kv_mesh = mesh
        self.num_shards = plan.mesh.data
        self.rows_per_shard = plan.device.max_concurrency
        self.max_concurrency = self.num_shards * self.rows_per_shard
        self.max_context = plan.max_context
        self.logical_pages = plan.logical_pages
        self.identity = next_store_serial()
        self.shards: tuple[KVStore, ...] = tuple(
            KVStore(plan.shard, entitlement=entitlement, requires_state_image=requires_state_image,
                    fault_injector=fault_injector, host_bytes=host_bytes, identity=self.identity)
            for _ in range(self.num_shards)
        )

    # -- shards and rows -----------------------------------------------------------------------------
    def locate_shard(self, shard) -> int:
        """``shard`` as an int after checking it names a data shard (``ValueError`` otherwise)."""
        if not isinstance(shard, (int, np.integer)) or isinstance(shard, bool) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard={shard!r} is invalid; it must be an integer in [0, {self.num_shards - 1}]")
        return int(shard)

    def store(self, shard: int) -> KVStore:
        """The :class:`KVStore` of data shard ``shard``."""
        return self.shards[self.locate_shard(shard)]

    def shard_of(self, handle: "ShardedSequence | ShardedCheckpoint") -> int:
        """The data shard a sharded sequence or checkpoint lives on."""
        return self.locate(handle)[0]

    def locate(self, handle) -> tuple[int, Any]:
        """``(data shard, the shard store's own handle)`` of a :class:`ShardedSequence` or
        :class:`ShardedCheckpoint`."""
        if not isinstance(handle, (ShardedSequence, ShardedCheckpoint)):
            raise TypeError(f"expected a ShardedSequence or ShardedCheckpoint, got {type(handle).__name__}")
        return self.locate_shard(handle.shard), handle.handle

    def row(self, handle: ShardedSequence) -> int:
        """The global row: ``shard * C_local + local row``."""
        d, h = self.locate(handle)
        return d * self.rows_per_shard + self.shards[d].row(h)

    def split_rows(self, rows) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Group global rows by shard: ``[(shard, positions in rows, local rows), ...]`` (shard order)."""
        rows = as_index_vector("rows", rows)  # the single store's rule: TypeError, then RowError
        bad = (rows < 0) | (rows >= self.max_concurrency)
        if bad.any():
            raise RowError(
                f"rows: row {int(rows[bad][0])} is outside [0, {self.max_concurrency}) (global execution rows of "
                f"this store)"
            )
        shard = rows // self.rows_per_shard
        out = []
        for d in np.unique(shard).tolist():
            at = np.flatnonzero(shard == d)
            out.append((d, at, (rows[at] - d * self.rows_per_shard).astype(np.int64)))
        return out

    def batch_rows(self, handles_per_shard, batch_per_shard: int) -> np.ndarray:
        """A step's ``(D * B_local,)`` global rows: shard ``d``'s sequences fill batch slots
        ``[d * B_local, (d + 1) * B_local)``, unused slots get the inert row ``C`` (out of range)."""
        if len(handles_per_shard) != self.num_shards:
            raise ValueError(f"handles_per_shard has {len(handles_per_shard)} lists, the mesh has {self.num_shards} data shards")
        out = np.full(self.num_shards * batch_per_shard, self.max_concurrency, np.int32)
        for d, hs in enumerate(handles_per_shard):
            if len(hs) > batch_per_shard:
                raise ValueError(f"shard {d} has {len(hs)} sequences, more than batch_per_shard={batch_per_shard}")
            for i, h in enumerate(hs):
                if self.shard_of(h) != d:
                    raise ValueError(f"a sequence of shard {self.shard_of(h)} is listed under shard {d}")
                out[d * batch_per_shard + i] = self.row(h)
        return out

    # -- lifecycle -----------------------------------------------------------------------------------
    def activate(self, prompt_tokens: int, max_new_tokens: int = 0, *, shard: int,
                 source: ShardedCheckpoint | None = None, source_tokens: int | None = None,
                 release_source: bool = False) -> ShardedSequence:
        """Activate a sequence on data shard ``shard`` (chosen by the caller), atomically over the
        shard's pools.  ``source`` must live on the same shard, else :class:`CrossShardError`;
        ``source_tokens`` continues a prefix of it, as in :meth:`KVStore.activate`."""
        d = self.locate_shard(shard)
        local = None
        if source is not None:
            s, local = self.locate(source)
            if not isinstance(source, ShardedCheckpoint):
                raise TypeError(f"source must be a ShardedCheckpoint, got {type(source).__name__}")
            if s != d:
                raise CrossShardError(
                    f"the checkpoint lives on data shard {s}, the activation names shard {d}; pages never cross "
                    f"shards: activate on shard {s} (store.shard_of(checkpoint)) or from the root"
                )
        h = self.shards[d].activate(prompt_tokens, max_new_tokens, source=local, source_tokens=source_tokens,
                                    release_source=release_source)
        return ShardedSequence(d, h)

    def finish(self, handle: ShardedSequence, *, retain: bool = False, state_image: Any = None,
               frontiers: Mapping | None = None) -> ShardedCheckpoint | None:
        """:meth:`KVStore.finish` on the sequence's shard; returns a :class:`ShardedCheckpoint` when retained."""
        d, h = self.locate(handle)
        ck = self.shards[d].finish(h, retain=retain, state_image=state_image, frontiers=frontiers)
        return None if ck is None else ShardedCheckpoint(d, ck)

    def release_checkpoint(self, handle: ShardedCheckpoint) -> None:
        """:meth:`KVStore.release_checkpoint` on the checkpoint's shard."""
        d, h = self.locate(handle)
        self.shards[d].release_checkpoint(h)

    def checkpoint(self, handle: ShardedCheckpoint):
        """:meth:`KVStore.checkpoint` of a sharded checkpoint (its shard's :class:`CheckpointInfo`)."""
        d, h = self.locate(handle)
        return self.shards[d].checkpoint(h)

    # -- row verbs: global rows, or one sharded sequence -------------------------------------------------
    def truncate(self, handle: ShardedSequence, frontier: int, *, pool="main", provisional: int = 0) -> None:
        """:meth:`KVStore.truncate` on the sequence's shard (also how a quarantined sequence returns)."""
        d, h = self.locate(handle)
        self.shards[d].truncate(h, frontier, pool=pool, provisional=provisional)

    def _per_shard(self, verb: str, rows, *columns, pool=PoolKind.MAIN) -> int:
        """Run a row verb per shard: a :class:`ShardedSequence` on its own shard; global rows split
        by shard, every shard's part checked first with the shard's public ``check_<verb>`` (which
        raises exactly what the verb would, changing nothing), then applied, so a refused call
        changes no shard and raises the error a single store raises."""
        if isinstance(rows, ShardedSequence):
            d, h = self.locate(rows)
            return getattr(self.shards[d], verb)(h, *columns, pool=pool)
        rows = as_index_vector("rows", rows)
        groups = self.split_rows(rows)
        cols = [None if c is None else as_index_vector(verb + " values", c) for c in columns]
        for c in cols:
            if c is not None and c.shape != rows.shape:
                raise ValueError(f"rows {rows.shape} and the values {c.shape} must be 1-D of one length")
        parts = [(d, local, [None if c is None else c[at] for c in cols]) for d, at, local in groups]
        for d, local, args in parts:
            getattr(self.shards[d], f"check_{verb}")(local, *args, pool=pool)
        total = 0
        for d, local, args in parts:
            got = getattr(self.shards[d], verb)(local, *args, pool=pool)
            total += int(got or 0)
        return total

    def map(self, rows, targets, *, pool=PoolKind.MAIN) -> int:
        """:meth:`KVStore.map` over global rows (each shard maps its own rows; a bad target on any
        shard refuses the whole call, no shard changed) or of one :class:`ShardedSequence`."""
        return self._per_shard("map", rows, targets, pool=pool)

    def commit(self, rows, frontiers, *, pool=PoolKind.MAIN) -> None:
        """:meth:`KVStore.commit` over global rows (every shard's frontiers checked first) or of one
        :class:`ShardedSequence`."""
        self._per_shard("commit", rows, frontiers, pool=pool)

    def trim(self, rows, keep_tokens=None, *, pool=PoolKind.MAIN) -> int:
        """:meth:`KVStore.trim` over global rows (every shard's part checked first, pinned pages
        included, so a refused trim changes no shard) or of one :class:`ShardedSequence`."""
        return self._per_shard("trim", rows, keep_tokens, pool=pool)

    def settle(self, rows, accepted, provisional=None, *, pool=PoolKind.MAIN) -> int:
        """:meth:`KVStore.settle` over global rows (every shard's part checked first) or of one
        :class:`ShardedSequence`."""
        return self._per_shard("settle", rows, accepted, provisional, pool=pool)

    def round_boundary(self, rows=None, *, step_tokens: int = 1) -> RoundGrant:
        """:meth:`KVStore.round_boundary` per shard over global rows (default: every active row);
        the grant's ``rows`` are global, in the order given."""
        if rows is None:
            rows = np.array([d * self.rows_per_shard + r for d, s in enumerate(self.shards) for r in s.active_rows()],
                            np.int64)
        as_index("step_tokens", step_tokens, 1)
        groups = self.split_rows(rows)
        rows = as_index_vector("rows", rows)
        for d, _, local in groups:
            self.shards[d].check_rows(local)
        covered = np.zeros(rows.shape, np.int64)
        limited = np.zeros(rows.shape, bool)
        granted = {k: np.zeros(rows.shape, np.int64) for k in self.plan.shard.pools}
        for d, at, local in groups:
            g = self.shards[d].round_boundary(local, step_tokens=step_tokens)
            covered[at], limited[at] = g.covered_tokens, g.length_limited
            for k, v in g.granted_pages.items():
                granted[k][at] = v
        return RoundGrant(rows=rows.astype(np.int64), covered_tokens=covered, length_limited=limited,
                          granted_pages=granted)

    # -- device state and work ---------------------------------------------------------------------------
    @property
    def work_serial(self) -> int:
        """Round works handed out so far (every take covers every shard)."""
        return self.shards[0].work_serial

    def global_pools(self) -> dict[PoolKind, PoolPlan]:
        """Every pool as one global array: ``D * N_local`` pages, ``D * C_local`` table rows, every
        stored head."""
        out = {}
        for kind, p in self.plan.shard.pools.items():
            out[kind] = PoolPlan(kind, p.layout, p.physical_pages * self.num_shards, p.logical_pages,
                                 p.max_concurrency * self.num_shards)
        return out

    def layout(self, pool="main"):
        """The layout each **device** holds (``H_local`` heads): build views inside ``shard_map`` with it."""
        return self.plan.device.pools[PoolKind.parse(pool)].layout

    def take_work(self) -> ShardedRoundWork:
        """Every shard's round work since the last take, stacked per shard (host arrays; apply with
        :func:`~ninfer_kv.device.sharded_ops.sharded_apply_work` after :meth:`ShardedRoundWork.device_put`)."""
        return stack_works([s.take_work() for s in self.shards])

    def require_synced(self, state) -> None:
        """Raise :class:`WorkOrderError` unless ``state`` applied exactly the works taken so far (the
        message says what happened and how to repair it: :func:`~ninfer_kv.resync`)."""
        if not hasattr(state, "sync_status"):
            raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
        problem = self.shards[0].sync_problem(state.sync_status())
        if problem is not None:
            raise WorkOrderError(problem)

    def plan_resync(self, status) -> tuple[ShardedRoundWork | None, ResyncReport]:
        """Every shard's :meth:`KVStore.plan_resync`, stacked (one serial for all shards); the report
        names :class:`ShardedSequence` / :class:`ShardedCheckpoint` handles."""
        plans = [s.plan_resync(status) for s in self.shards]
        if plans[0][0] is None:
            return None, plans[0][1]
        seqs, ckpts, replayed = {}, {}, {}
        for d, (_, rep) in enumerate(plans):
            seqs.update({ShardedSequence(d, h): v for h, v in rep.lost_sequences.items()})
            ckpts.update({ShardedCheckpoint(d, h): v for h, v in rep.lost_checkpoints.items()})
            for k, (c, r) in rep.replayed.items():
                c0, r0 = replayed.get(k, (0, 0))
                replayed[k] = (c0 + c, r0 + r)
        first = plans[0][1]
        report = ResyncReport(applied=first.applied, serial=first.serial, lost_sequences=seqs,
                              lost_checkpoints=ckpts, replayed=replayed,
                              cancelled_offloads=sum(rep.cancelled_offloads for _, rep in plans))
        return stack_works([w for w, _ in plans]), report

    def lost(self) -> dict:
        """Every shard's quarantined handles (see :meth:`KVStore.lost`), as sharded handles."""
        out = {}
        for d, s in enumerate(self.shards):
            for h, v in s.lost().items():
                out[ShardedSequence(d, h) if isinstance(h, SequenceHandle) else ShardedCheckpoint(d, h)] = v
        return out

    # -- Host tier (one arena per data shard) ------------------------------------------------------------
    def drop_device_replica(self, handle: ShardedCheckpoint) -> int:
        """:meth:`KVStore.drop_device_replica` on the checkpoint's shard."""
        d, h = self.locate(handle)
        return self.shards[d].drop_device_replica(h)

    def restore_checkpoint(self, handle: ShardedCheckpoint, *, drop_host: bool = False):
        """Host -> Device on the checkpoint's own shard (the pages land with the next work)."""
        d, h = self.locate(handle)
        return self.shards[d].restore_checkpoint(h, drop_host=drop_host)

    def release_host_replica(self, handle: ShardedCheckpoint) -> int:
        """:meth:`KVStore.release_host_replica` on the checkpoint's shard."""
        d, h = self.locate(handle)
        return self.shards[d].release_host_replica(h)

    # -- inspection ----------------------------------------------------------------------------------
    def host_block_table(self, pool="main") -> np.ndarray:
        """The store's ``(D * C_local, L)`` block table (each shard's rows hold that shard's page IDs)."""
        return np.concatenate([s.host_block_table(pool) for s in self.shards])

    def audit_invariants(self) -> None:
        """Every shard's invariants (pages, references, reservations, tables)."""
        for s in self.shards:
            s.audit_invariants()

    def occupancy(self, pool="main") -> list:
        """Every shard's :class:`PoolOccupancy` of ``pool``, in shard order."""
        return [s.occupancy(pool) for s in self.shards]

    def sequences(self) -> list[ShardedSequence]:
        """Every shard's active sequences as :class:`ShardedSequence` handles."""
        return [ShardedSequence(d, h) for d, s in enumerate(self.shards) for h in s.sequences()]

    def checkpoints(self) -> list[ShardedCheckpoint]:
        """Every shard's retained checkpoints as :class:`ShardedCheckpoint` handles."""
        return [ShardedCheckpoint(d, h) for d, s in enumerate(self.shards) for h in s.checkpoints()]

    def snapshot(self) -> list[dict]:
        """Every shard's :meth:`KVStore.snapshot`, in shard order."""
        return [s.snapshot() for s in self.shards]
