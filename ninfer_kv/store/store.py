"""KVStore: the program-level facade over every growing pool (host-only bookkeeping).

The store keeps, per enabled pool (one per :class:`~ninfer_kv.planning.PoolKind` of the plan), a
:class:`DevicePagePool`, the logical page descriptors, the address spaces, the host mirror of the
``int32 (C, L)`` block-table matrix and the pool's pending page writes.  It decides Move / Fork /
COW from the real references and keeps every transition atomic across pools.  It holds no
``jax.Array`` and launches no device work: the caller owns a :class:`KVDeviceState` and applies the
store's round work inside its own jitted step.

Life of a sequence::

    state = store.allocate_state()                 # planes + block tables, caller-owned
    h = store.activate(prompt_tokens, max_new_tokens, source=ckpt_or_None, release_source=False)
    store.ensure_mapped_to_tokens(h, n)            # before a unit that writes up to n tokens
    work = store.take_work()                       # table rows, COW copies, Host restores
    state, out = step(state, work, ...)            # the jitted step runs apply_work(state, work) first
    store.commit(h, frontier)                      # only after the unit succeeded
    store.settle(h, accepted, provisional=...)     # speculative: commit accepted, trim rejected tails
    ckpt = store.finish(h, retain=True, state_image=token)   # or retain=False
    store.release_checkpoint(ckpt)

The verb families live in their own modules: :mod:`.activation` (activate, finish, release),
:mod:`.row_verbs` (map / commit / trim / settle, per handle and vectorized per row),
:mod:`.host_verbs` (the Host tier) and :mod:`.inspection` (summaries, invariants, snapshots).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..geometry import PAGE_SIZE
from ..planning import KVPlan, KVPoolSetLayout, PoolKind, SpeculativeBackend
from .activation import ACTIVATION_STAGES, ActivationVerbs
from .address_space import KVAddressSpace
from .bundle import CheckpointHandle, CheckpointInfo, HandleRegistry, SequenceHandle, SequenceKVBundle, _Record
from .bundle import next_store_serial
from .device_state import BLANK, KVDeviceState, SyncStatus
from .entitlement import EntitlementPolicy
from .errors import LostContentError, WorkOrderError
from .frontier_history import DEFAULT_WINDOW
from .host_replicas import HostTier, placement_of
from .host_verbs import HostVerbs
from .inspection import InspectionVerbs
from .repair import ResyncReport, dated_epoch
from .round_work import PageWrites, PendingWork, RoundWork
from .row_verbs import RowVerbs
from .rows import ExecutionRows
from .runtime import PoolRuntime
from .summary import HostTransferStats

__all__ = ["KVStore", "ACTIVATION_STAGES", "FaultInjector"]

FaultInjector = Callable[[str, "PoolKind | None"], None]


def _works(n: int) -> str:
    return f"{n} round work" + ("" if n == 1 else "s")


class KVStore(ActivationVerbs, RowVerbs, HostVerbs, InspectionVerbs):
    """Host-side KV store over the pools of a plan.

    Args:
      plan: a :class:`KVPlan` (from ``plan_kv_cache``) or a :class:`KVPoolSetLayout` with ``m``.
      m: Main page groups when ``plan`` is a :class:`KVPoolSetLayout`.
      entitlement: the :class:`EntitlementPolicy` (default: full prompt + output budget).
      requires_state_image: the model needs a state image to resume from a frontier (e.g. it has
        recurrent state).  Then ``finish(retain=True)`` must be given one; KV alone is not a hit.
      device: default device of :meth:`allocate_state` and of a Host arena made from ``host_bytes``.
      fault_injector: test hook ``f(stage, pool)`` called before each activation stage and each
        Host transfer stage (``OFFLOAD_STAGES``, ``RESTORE_STAGES``).
      host_arena: a :class:`~ninfer_kv.host.HostKVArena` for the Host replica tier (shared by every
        pool; it must be empty: the store allocates and frees every extent in it).
      host_bytes: alternatively, the capacity of a new arena for ``device``.  Neither: no Host tier.
      history_window: takes a device state may lag behind the store and still be repaired by
        :func:`~ninfer_kv.resync` without treating recent content as lost (see
        :mod:`~ninfer_kv.store.frontier_history`; memory ``window * C * 8`` bytes per pool).
      identity: the store identity its works, states and offload payloads carry (default: a fresh
        one per store; a :class:`ShardedKVStore` gives every shard its own).
    """

    def __init__(
        self,
        plan: "KVPlan | KVPoolSetLayout",
        m: int | None = None,
        *,
        entitlement: EntitlementPolicy | None = None,
        requires_state_image: bool = False,
        device=None,
        fault_injector: FaultInjector | None = None,
        host_arena=None,
        host_bytes: int | None = None,
        history_window: int = DEFAULT_WINDOW,
        identity: int | None = None,
    ):
        if isinstance(plan, KVPlan):
            if m is not None and m != plan.m:
                raise ValueError(f"m={m} disagrees with the plan's M={plan.m}")
            builder, pools = plan.builder, plan.pools
        elif isinstance(plan, KVPoolSetLayout):
            if m is None:
                raise ValueError("a KVPoolSetLayout needs m (Main page groups)")
            builder, pools = plan, plan.pools(m)
        else:
            raise TypeError(f"plan must be a KVPlan or KVPoolSetLayout, got {type(plan).__name__}")
        self.builder = builder
        self.pool_plans = dict(pools)
        self.max_context = builder.max_context
        self.max_concurrency = builder.max_concurrency
        self.logical_pages = builder.logical_pages
        self.page_size = PAGE_SIZE
        self.policy = entitlement or EntitlementPolicy()
        self.requires_state_image = bool(requires_state_image)
        self.fault_injector = fault_injector
        self.device = device
        spec = builder.speculative
        self._rt: dict[PoolKind, PoolRuntime] = {}
        for kind, pool_plan in pools.items():
            lead = spec.draft_window - 1 if kind is PoolKind.MTP and spec.backend is SpeculativeBackend.MTP else 0
            self._rt[kind] = PoolRuntime(pool_plan, lead_tokens=lead, history_window=history_window)
        self._main = self._rt[PoolKind.MAIN]
        self._rows = ExecutionRows(self.max_concurrency)
        self._registry = HandleRegistry(next_store_serial())
        self.identity: int = self._registry.store if identity is None else int(identity)
        """Identity carried by this store's works, states and offload payloads (>= 1)."""
        self._work_serial = 0
        self._host: HostTier | None = None
        arena = self._make_arena(host_arena, host_bytes, device)
        if arena is not None:
            self._host = HostTier(arena, self._rt, self._fault, self.identity)
        # Host transfer counters (offloaded_pages, restored_pages, ...; zeros without a Host tier)
        self.stats: HostTransferStats = self._host.stats if self._host is not None else HostTransferStats()

    @staticmethod
    def _make_arena(host_arena, host_bytes, device):
        if host_arena is not None and host_bytes is not None:
            raise ValueError("pass either host_arena or host_bytes, not both")
        if host_bytes is not None:
            from ..host import HostKVArena
            from ..units import byte_count

            # an integer, a whole-number float or a byte-size string such as "64MiB"
            return HostKVArena(byte_count(host_bytes, "host_bytes", minimum=1), device=device)
        return host_arena

    # -- pools -------------------------------------------------------------------------------------------
    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The enabled pools, Main first."""
        return tuple(self._rt)

    def _runtime(self, pool) -> PoolRuntime:
        if pool.__class__ is PoolKind:
            rt = self._rt.get(pool)
            if rt is not None:
                return rt
        kind = PoolKind.parse(pool)
        try:
            return self._rt[kind]
        except KeyError:
            raise ValueError(f"pool {kind.value} is not enabled; enabled pools: {[k.value for k in self._rt]}") from None

    def pool(self, pool="main"):
        """The :class:`DevicePagePool` of ``pool`` (a ``PoolKind`` or its name)."""
        return self._runtime(pool).pool

    def layout(self, pool="main"):
        """The :class:`PagedKVStorageLayout` of ``pool``."""
        return self._runtime(pool).layout

    # -- device state and round work ---------------------------------------------------------------------
    @property
    def work_serial(self) -> int:
        """Round works handed out so far (a state that applied all of them has this ``serial``)."""
        return self._work_serial

    def allocate_state(self, *, device=None, fill=None) -> KVDeviceState:
        """A fresh :class:`KVDeviceState` for this store: zero (or ``fill``) planes, sentinel
        tables, serial 0.

        After works were taken the fresh state holds none of their content: it is returned
        *blank* (poisoned: every op over it is dropped) and :func:`~ninfer_kv.resync` brings it in
        line — restoring what Host replicas hold and quarantining what is gone.  That is the way
        back from a state lost to a failed donated step."""
        device = device if device is not None else self.device
        return KVDeviceState.zeros(self.pool_plans, device=device, fill=fill, blank=self._work_serial > 0,
                                   owner=self.identity)

    def take_work(self) -> RoundWork:
        """Everything the device must do before the next unit reads, since the last take.

        Per pool: the block-table entries written since (``int32 (3, U)``), the partial-tail COW
        copies (``int32 (3, K)``) and the Host restores (``int32 (2, R)`` plus the payload), in
        bucketed shapes.  Apply it with :func:`~ninfer_kv.apply_work` (inside the caller's step, or
        :func:`~ninfer_kv.apply_work_jit`) before the next unit; works apply in order, none skipped.
        """
        pools = {kind: rt.take_work() for kind, rt in self._rt.items()}
        work = RoundWork(serial=np.asarray(self._work_serial, np.int32), pools=pools,
                         store=np.asarray(self.identity, np.int32))
        self._work_serial += 1
        return work

    def pending_work(self) -> dict[PoolKind, PendingWork]:
        """What the next :meth:`take_work` will hold, per pool: :class:`PendingWork` ``(tables,
        copies, restores)`` — distinct block-table entries, COW copies and Host restores, the entries
        that carry work (``RoundWork.counts()`` gives the bucketed buffer sizes a take pads them to,
        ``PoolWork.used()`` the entries of a taken work that carry work)."""
        return {k: rt.pending_work() for k, rt in self._rt.items()}

    def check_state(self, state: KVDeviceState) -> None:
        """Raise :class:`WorkOrderError` unless ``state`` applied exactly the works taken so far, in
        order (reads the state's serial: waits for the state).  The message says what happened and
        how to repair it (:func:`~ninfer_kv.resync`)."""
        if not isinstance(state, KVDeviceState):
            raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
        problem = self.sync_problem(state.sync_status())
        if problem is not None:
            raise WorkOrderError(problem)

    def sync_problem(self, status: SyncStatus) -> str | None:
        """What is wrong with a state at ``status`` (``None``: it applied every work in order)."""
        taken = self._work_serial
        fix = "; repair it with `state, report = ninfer_kv.resync(store, state)`"
        if status.owner not in (0, self.identity):
            return (f"the device state belongs to store {status.owner}, not to this store ({self.identity}): use the "
                    f"state this store allocated")
        if status.poisoned:
            if status.offending == BLANK:
                return (f"the device state is blank: it was allocated after {_works(taken)} were taken and holds "
                        f"none of their content" + fix)
            if status.offending_store not in (None, 0, self.identity):
                return (f"the device state is poisoned: it applied {_works(status.applied)} in order, then was "
                        f"given work {status.offending} of store {status.offending_store}, another store (this one is "
                        f"{self.identity}); since then every op over it is dropped" + fix)
            how = "skipped" if status.offending > status.applied else "repeated or reordered"
            return (f"the device state is poisoned: it applied {_works(status.applied)} in order, then was given "
                    f"work {status.offending} (a work was {how}); since then every op over it is dropped" + fix)
        if status.applied > taken:
            return (f"the device state applied {_works(status.applied)} but this store handed out only {taken}: "
                    f"it belongs to another store")
        if status.applied < taken:
            return (f"the device state applied {_works(status.applied)}; the store handed out {taken} (works "
                    f"{status.applied}..{taken - 1} were never applied)" + fix)
        return None

    # -- repair ------------------------------------------------------------------------------------------------
    def plan_resync(self, status: SyncStatus) -> tuple[RoundWork | None, ResyncReport]:
        """The host half of :func:`~ninfer_kv.resync` for a state at ``status``: the work that brings it
        in line (every block table republished, missed page writes replayed; its serial is the
        store's current one, and the state must be reset to it before applying) and the report.
        Content the device no longer holds is quarantined (see :mod:`~ninfer_kv.store.repair`).
        Returns ``(None, report)`` when the state is already in line."""
        taken = self._work_serial
        problem = self.sync_problem(status)
        if problem is None:
            return None, ResyncReport(applied=status.applied, serial=taken)
        if status.owner not in (0, self.identity) or status.applied > taken:
            raise WorkOrderError(problem if status.owner not in (0, self.identity) else (
                f"the device state applied {status.applied} round works but this store handed out only {taken}: it "
                f"belongs to another store"))
        epoch, applied = dated_epoch(status), max(0, min(status.applied, taken))
        cancelled = self._host.cancel_all() if self._host is not None else 0
        replays = {kind: PageWrites(rt.layout, rt.pool.capacity) for kind, rt in self._rt.items()}
        lost = {kind: rt.plan_resync(epoch, applied, replays[kind]) for kind, rt in self._rt.items()}
        lost_sequences, lost_checkpoints = {}, {}
        for kind_name, handles, found in (("sequence", self.sequences(), lost_sequences),
                                          ("checkpoint", self.checkpoints(), lost_checkpoints)):
            for h in handles:
                rec = self._registry.get(h)
                if not any(rec.slots[k] in lost[k] for k in self._rt) and rec.lost is None:
                    continue
                intact = {}
                for k, rt in self._rt.items():
                    slot = rec.slots[k]
                    now = int(rt.spaces.committed[slot])
                    intact[k] = min(lost[k].get(slot, now), (rec.lost or {}).get(k, now))
                rec.lost = intact
                found[h] = dict(intact)
                if kind_name == "sequence":
                    self._rows.set_quarantined(rec.row, True)
                    for rt in self._rt.values():
                        rt.table.clear_row(rec.row)
        replayed = {k: w.counts() for k, w in replays.items()}
        pools = {}
        for kind, rt in self._rt.items():
            rt.table.mark_all()
            pools[kind] = rt.take_work(writes=replays[kind])
        work = RoundWork(serial=np.asarray(taken, np.int32), pools=pools, store=np.asarray(self.identity, np.int32))
        self._work_serial += 1
        report = ResyncReport(applied=status.applied, serial=self._work_serial, lost_sequences=lost_sequences,
                              lost_checkpoints=lost_checkpoints, replayed=replayed, cancelled_offloads=cancelled)
        return work, report

    def _revive_if_intact(self, rec: _Record) -> None:
        """Return a quarantined sequence to service once no pool commits beyond its intact frontier."""
        if rec.lost is None:
            return
        if any(int(rt.spaces.committed[rec.row]) > rec.lost[k] for k, rt in self._rt.items()):
            return
        rec.lost = None
        self._rows.set_quarantined(rec.row, False)
        for rt in self._rt.values():
            rt.publish_row(rec.row)

    @staticmethod
    def _lost_error(handle, rec: _Record, verb: str) -> LostContentError:
        what = type(handle).__name__
        intact = ", ".join(f"{k.value}: {v} tokens" for k, v in rec.lost.items())
        out = "finish it (retain=False) or truncate it to those frontiers" if rec.kind == "sequence" else "release it"
        return LostContentError(
            f"{what}(id={handle.id}) was quarantined by a resync: the device lost part of its committed content "
            f"(intact: {intact}); {verb} refused, {out}"
        )

    def _serial_of(self, kind: PoolKind, ids: np.ndarray) -> int:
        """The serial a state must reach to hold device pages ``ids``' current content."""
        pending = self._rt[kind].writes.touches(ids)
        return self._work_serial + (1 if pending else 0)

    # -- handles ---------------------------------------------------------------------------------------------
    def _sequence(self, handle, verb: str | None = None) -> _Record:
        """The record of a sequence handle; with ``verb``, refused while quarantined."""
        if not isinstance(handle, SequenceHandle):
            raise TypeError(f"expected a SequenceHandle, got {type(handle).__name__}")
        rec = self._registry.get(handle)
        if verb is not None and rec.lost is not None:
            raise self._lost_error(handle, rec, verb)
        return rec

    def _checkpoint(self, handle, verb: str | None = None) -> _Record:
        """The record of a checkpoint handle; with ``verb``, refused while quarantined."""
        if not isinstance(handle, CheckpointHandle):
            raise TypeError(f"expected a CheckpointHandle, got {type(handle).__name__}")
        rec = self._registry.get(handle)
        if verb is not None and rec.lost is not None:
            raise self._lost_error(handle, rec, verb)
        return rec

    def _handle_row(self, handle, verb: str = "the verb") -> np.ndarray:
        """The one-row vector of a sequence handle, through the row verbs' validation."""
        return self._rows.check_one(self._sequence(handle, verb).row)

    def row(self, handle: SequenceHandle) -> int:
        """The execution row (block-table row in every pool) of an active sequence."""
        return self._sequence(handle).row

    def bundle(self, handle: SequenceHandle) -> SequenceKVBundle:
        """The :class:`SequenceKVBundle` of an active sequence: its row and its address space in every pool."""
        rec = self._sequence(handle)
        spaces = {k: KVAddressSpace(rt, rec.row, int(rt.spaces.generation[rec.row])) for k, rt in self._rt.items()}
        return SequenceKVBundle(handle, rec.row, spaces)

    def address_space(self, handle, pool="main") -> KVAddressSpace:
        """The address space of a sequence or checkpoint in ``pool``."""
        rec = self._registry.get(handle)
        rt = self._runtime(pool)
        slot = rec.slots[rt.kind]
        return KVAddressSpace(rt, slot, int(rt.spaces.generation[slot]))

    def checkpoint(self, handle: CheckpointHandle) -> CheckpointInfo:
        """What a retained checkpoint holds: :class:`CheckpointInfo` (frontiers, state image, reusability, placement)."""
        rec = self._checkpoint(handle)
        frontiers = {k: int(rt.spaces.committed[rec.slots[k]]) for k, rt in self._rt.items()}
        spaces = {
            k: KVAddressSpace(rt, rec.slots[k], int(rt.spaces.generation[rec.slots[k]])) for k, rt in self._rt.items()
        }
        placement, counts = self._placement(rec)
        return CheckpointInfo(handle, frontiers, rec.state_image, self._reusable(rec), spaces, placement, counts)

    def _placement(self, rec: _Record) -> tuple[str, dict]:
        if self._host is not None:
            return self._host.placement(rec.slots)
        n = sum(int(self._rt[k].spaces.n_blocks[s]) for k, s in rec.slots.items())
        return placement_of(np.ones(n, bool), np.zeros(n, bool))

    def _reusable(self, rec: _Record) -> bool:
        return rec.lost is None and set(rec.slots) == set(self._rt) and (rec.state_image is not None or not self.requires_state_image)

    def sequences(self) -> list[SequenceHandle]:
        """Handles of every active sequence (quarantined ones included)."""
        return self._registry.handles("sequence")

    def checkpoints(self) -> list[CheckpointHandle]:
        """Handles of every retained checkpoint (quarantined ones included)."""
        return self._registry.handles("checkpoint")

    def lost(self) -> dict:
        """``{handle: {PoolKind: intact frontier}}`` of every sequence and checkpoint quarantined by a
        resync and not yet released or returned to service."""
        out = {}
        for h in self.sequences() + self.checkpoints():
            rec = self._registry.get(h)
            if rec.lost is not None:
                out[h] = dict(rec.lost)
        return out

    def active_rows(self) -> np.ndarray:
        """Execution rows leased to active sequences, ascending (``int64 (n,)``)."""
        return self._rows.active()

    def _fault(self, stage: str, kind: PoolKind | None) -> None:
        if self.fault_injector is not None:
            self.fault_injector(stage, kind)
