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
from .device_state import POISONED, KVDeviceState
from .entitlement import EntitlementPolicy
from .errors import LifecycleError, WorkOrderError
from .host_replicas import HostTier, placement_of
from .host_verbs import HostVerbs
from .inspection import InspectionVerbs
from .round_work import PoolWork, RoundWork
from .row_verbs import RowVerbs
from .rows import ExecutionRows
from .runtime import PoolRuntime
from .summary import HostTransferStats

__all__ = ["KVStore", "ACTIVATION_STAGES", "FaultInjector"]

FaultInjector = Callable[[str, "PoolKind | None"], None]


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
            self._rt[kind] = PoolRuntime(pool_plan, lead_tokens=lead)
        self._main = self._rt[PoolKind.MAIN]
        self._rows = ExecutionRows(self.max_concurrency)
        self._registry = HandleRegistry(next_store_serial())
        self._work_serial = 0
        self._host: HostTier | None = None
        arena = self._make_arena(host_arena, host_bytes, device)
        if arena is not None:
            self._host = HostTier(arena, self._rt, self._fault)
        # Host transfer counters (offloaded_pages, restored_pages, ...; zeros without a Host tier)
        self.stats: HostTransferStats = self._host.stats if self._host is not None else HostTransferStats()

    @staticmethod
    def _make_arena(host_arena, host_bytes, device):
        if host_arena is not None and host_bytes is not None:
            raise ValueError("pass either host_arena or host_bytes, not both")
        if host_bytes is not None:
            if not isinstance(host_bytes, (int, np.integer)) or isinstance(host_bytes, bool) or host_bytes < 1:
                raise ValueError(f"host_bytes={host_bytes!r} is invalid; it must be an integer >= 1")
            from ..host import HostKVArena

            return HostKVArena(int(host_bytes), device=device)
        return host_arena

    # -- pools -------------------------------------------------------------------------------------------
    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
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
        tables, serial 0.  Only before the first :meth:`take_work` (a later state could not catch
        up on the works already handed out)."""
        if self._work_serial:
            raise LifecycleError(
                f"allocate_state after {self._work_serial} round works were taken: a fresh state starts at "
                f"serial 0 and would miss them"
            )
        return KVDeviceState.zeros(self.pool_plans, device=device if device is not None else self.device, fill=fill)

    def take_work(self) -> RoundWork:
        """Everything the device must do before the next unit reads, since the last take.

        Per pool: the block-table entries written since (``int32 (3, U)``), the partial-tail COW
        copies (``int32 (3, K)``) and the Host restores (``int32 (2, R)`` plus the payload), in
        bucketed shapes.  Apply it with :func:`~ninfer_kv.apply_work` (inside the caller's step, or
        :func:`~ninfer_kv.apply_work_jit`) before the next unit; works apply in order, none skipped.
        """
        pools = {}
        for kind, rt in self._rt.items():
            copies, restores, payload = rt.writes.take()
            pools[kind] = PoolWork(
                tables=rt.table.take(), copies=copies, restores=restores, payload=payload,
                pad_row=rt.rows, pad_page=rt.pool.capacity,
            )
        work = RoundWork(serial=np.asarray(self._work_serial, np.int32), pools=pools)
        self._work_serial += 1
        return work

    def pending_work(self) -> dict[PoolKind, tuple[int, int]]:
        """``{PoolKind: (dirty table entries, pending page writes)}`` waiting for :meth:`take_work`."""
        return {k: (rt.table.pending, len(rt.writes)) for k, rt in self._rt.items()}

    def check_state(self, state: KVDeviceState) -> None:
        """Raise :class:`WorkOrderError` unless ``state`` applied exactly the works taken so far, in
        order (reads the state's serial: waits for the state)."""
        if not isinstance(state, KVDeviceState):
            raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
        got = state.host_serial()
        if got == POISONED:
            raise WorkOrderError("the device state is poisoned: a round work was applied out of order (skipped or "
                                 "repeated)")
        if got != self._work_serial:
            raise WorkOrderError(
                f"the device state applied {got} round works; the store handed out {self._work_serial}"
            )

    def _serial_of(self, kind: PoolKind, ids: np.ndarray) -> int:
        """The serial a state must reach to hold device pages ``ids``' current content."""
        pending = self._rt[kind].writes.touches(ids)
        return self._work_serial + (1 if pending else 0)

    # -- handles ---------------------------------------------------------------------------------------------
    def _sequence(self, handle) -> _Record:
        if not isinstance(handle, SequenceHandle):
            raise TypeError(f"expected a SequenceHandle, got {type(handle).__name__}")
        return self._registry.get(handle)

    def _checkpoint(self, handle) -> _Record:
        if not isinstance(handle, CheckpointHandle):
            raise TypeError(f"expected a CheckpointHandle, got {type(handle).__name__}")
        return self._registry.get(handle)

    def _handle_row(self, handle) -> np.ndarray:
        """The one-row vector of a sequence handle, through the row verbs' validation."""
        return self._rows.check_one(self._sequence(handle).row)

    def row(self, handle: SequenceHandle) -> int:
        """The execution row (block-table row in every pool) of an active sequence."""
        return self._sequence(handle).row

    def bundle(self, handle: SequenceHandle) -> SequenceKVBundle:
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
        return set(rec.slots) == set(self._rt) and (rec.state_image is not None or not self.requires_state_image)

    def sequences(self) -> list[SequenceHandle]:
        return self._registry.handles("sequence")

    def checkpoints(self) -> list[CheckpointHandle]:
        return self._registry.handles("checkpoint")

    def active_rows(self) -> np.ndarray:
        return self._rows.active()

    def _fault(self, stage: str, kind: PoolKind | None) -> None:
        if self.fault_injector is not None:
            self.fault_injector(stage, kind)
