"""StoreCore: the explicit state a :class:`~ninfer_kv.store.KVStore` is made of.

The store's verb families (:mod:`.activation`, :mod:`.row_verbs`, :mod:`.host_verbs`,
:mod:`.work_verbs`, :mod:`.inspection`) are separate objects composed over one core; each reads and
changes the store only through what this class declares:

* the plan's numbers (``pool_set``, ``pool_plans``, ``max_context``, ``max_concurrency``,
  ``logical_pages``, ``page_size``), the entitlement ``policy`` and ``requires_state_image``;
* ``runtimes`` — one :class:`~ninfer_kv.store.runtime.PoolRuntime` per enabled pool (``main`` is
  the Main one): every pool-level table and its transitions;
* ``rows`` (:class:`~ninfer_kv.store.rows.ExecutionRows`), ``registry``
  (:class:`~ninfer_kv.store.bundle.HandleRegistry`), ``host`` (the
  :class:`~ninfer_kv.store.host_tier.HostTier` or ``None``), ``stats``;
* ``work_serial`` (works handed out) and ``identity`` (carried by works, states and payloads);
* the lookups every family shares: :meth:`runtime`, :meth:`sequence_record`,
  :meth:`checkpoint_record`, :meth:`handle_row`, the quarantine helpers and :meth:`fault`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..schema.errors import LostContentError
from ..schema.geometry import PAGE_SIZE
from ..schema.kinds import PoolKind
from ..planning.pool_specs import POOL_SPECS
from .bundle import CheckpointHandle, HandleRegistry, SequenceHandle, _Record, next_store_serial
from .entitlement import EntitlementPolicy
from .host_tier import HostTier, placement_of
from .rows import ExecutionRows
from .runtime import PoolRuntime
from .summary import HostTransferStats

__all__ = ["StoreCore", "FaultInjector"]

FaultInjector = Callable[[str, "PoolKind | None"], None]


class StoreCore:
    """The state of one store and the lookups its verb families share (see the module docstring)."""

    def __init__(
        self,
        pool_set,
        pools,
        *,
        policy: EntitlementPolicy,
        requires_state_image: bool,
        device,
        fault_injector: FaultInjector | None,
        arena,
        history_window: int,
        identity: int | None,
    ):
        self.pool_set = pool_set
        self.pool_plans = dict(pools)
        self.max_context = pool_set.max_context
        self.max_concurrency = pool_set.max_concurrency
        self.logical_pages = pool_set.logical_pages
        self.page_size = PAGE_SIZE
        self.policy = policy
        self.requires_state_image = bool(requires_state_image)
        self.fault_injector = fault_injector
        self.device = device
        spec = pool_set.speculative
        self.runtimes: dict[PoolKind, PoolRuntime] = {
            kind: PoolRuntime(pool_plan, lead_tokens=POOL_SPECS[kind].lead_tokens(spec), history_window=history_window)
            for kind, pool_plan in self.pool_plans.items()
        }
        self.main = self.runtimes[PoolKind.MAIN]
        self.rows = ExecutionRows(self.max_concurrency)
        self.registry = HandleRegistry(next_store_serial())
        self.identity: int = self.registry.store if identity is None else int(identity)
        self.work_serial = 0
        self.host: HostTier | None = None
        if arena is not None:
            self.host = HostTier(arena, self.runtimes, self.fault, self.identity)
        # Host transfer counters (offloaded_pages, restored_pages, ...; zeros without a Host tier)
        self.stats: HostTransferStats = self.host.stats if self.host is not None else HostTransferStats()

    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The enabled pools, Main first."""
        return tuple(self.runtimes)

    def host_occupancy(self):
        """The Host tier's occupancy, or ``None`` without one."""
        return None if self.host is None else self.host.occupancy()

    def runtime(self, pool) -> PoolRuntime:
        """The :class:`PoolRuntime` of ``pool`` (a ``PoolKind`` or its name); ``ValueError`` when not enabled."""
        if pool.__class__ is PoolKind:
            rt = self.runtimes.get(pool)
            if rt is not None:
                return rt
        kind = PoolKind.parse(pool)
        try:
            return self.runtimes[kind]
        except KeyError:
            raise ValueError(
                f"pool {kind.value} is not enabled; enabled pools: {[k.value for k in self.runtimes]}"
            ) from None

    def fault(self, stage: str, kind: PoolKind | None) -> None:
        """Call the fault injector (a test hook) before ``stage`` of pool ``kind``."""
        if self.fault_injector is not None:
            self.fault_injector(stage, kind)

    def sequence_record(self, handle, verb: str | None = None) -> _Record:
        """The record of a sequence handle; with ``verb``, refused while quarantined."""
        if not isinstance(handle, SequenceHandle):
            raise TypeError(f"expected a SequenceHandle, got {type(handle).__name__}")
        rec = self.registry.get(handle)
        if verb is not None and rec.lost is not None:
            raise self.lost_error(handle, rec, verb)
        return rec

    def checkpoint_record(self, handle, verb: str | None = None) -> _Record:
        """The record of a checkpoint handle; with ``verb``, refused while quarantined."""
        if not isinstance(handle, CheckpointHandle):
            raise TypeError(f"expected a CheckpointHandle, got {type(handle).__name__}")
        rec = self.registry.get(handle)
        if verb is not None and rec.lost is not None:
            raise self.lost_error(handle, rec, verb)
        return rec

    def handle_row(self, handle, verb: str = "the verb") -> np.ndarray:
        """The one-row vector of a sequence handle, through the row verbs' validation."""
        return self.rows.check_one(self.sequence_record(handle, verb).row)

    @staticmethod
    def lost_error(handle, rec: _Record, verb: str) -> LostContentError:
        """The :class:`LostContentError` refusing ``verb`` on a quarantined handle."""
        what = type(handle).__name__
        intact = ", ".join(f"{k.value}: {v} tokens" for k, v in rec.lost.items())
        out = "finish it (retain=False) or truncate it to those frontiers" if rec.kind == "sequence" else "release it"
        return LostContentError(
            f"{what}(id={handle.id}) was quarantined by a resync: the device lost part of its committed content "
            f"(intact: {intact}); {verb} refused, {out}"
        )

    def revive_if_intact(self, rec: _Record) -> None:
        """Return a quarantined sequence to service once no pool commits beyond its intact frontier."""
        if rec.lost is None:
            return
        if any(int(rt.spaces.committed[rec.row]) > rec.lost[k] for k, rt in self.runtimes.items()):
            return
        rec.lost = None
        self.rows.set_quarantined(rec.row, False)
        for rt in self.runtimes.values():
            rt.publish_row(rec.row)

    def serial_of(self, kind: PoolKind, ids: np.ndarray) -> int:
        """The serial a state must reach to hold device pages ``ids``' current content."""
        pending = self.runtimes[kind].writes.touches(ids)
        return self.work_serial + (1 if pending else 0)

    def reusable(self, rec: _Record) -> bool:
        """Whether activation may resume from checkpoint ``rec``: not quarantined, every pool present
        and, when the store requires one, a state image held."""
        complete = set(rec.slots) == set(self.runtimes)
        return rec.lost is None and complete and (rec.state_image is not None or not self.requires_state_image)

    def placement(self, rec: _Record) -> tuple[str, dict]:
        """Where checkpoint ``rec``'s pages have replicas: ``(placement, page counts)``."""
        if self.host is not None:
            return self.host.placement(rec.slots)
        n = sum(int(self.runtimes[k].spaces.n_blocks[s]) for k, s in rec.slots.items())
        return placement_of(np.ones(n, bool), np.zeros(n, bool))

    def sequences(self) -> list[SequenceHandle]:
        """Handles of every active sequence (quarantined ones included)."""
        return self.registry.handles("sequence")

    def checkpoints(self) -> list[CheckpointHandle]:
        """Handles of every retained checkpoint (quarantined ones included)."""
        return self.registry.handles("checkpoint")
