"""KV store: typed page pools, logical pages, address spaces, block tables and Host replicas.

Public entry points: :class:`KVStore` (Python bookkeeping over every pool), its handles
(:class:`SequenceHandle`, :class:`CheckpointHandle`) and what its verbs report (infos, occupancy,
Host transfers, resync reports).  See ``docs/API.md`` ("## Store", "## Host tier") for the verbs.
The tables the store composes (address spaces, logical pages, block tables, execution rows) are
internals, importable from their own modules for tests and debugging.

The store's part of the Host tier (page replicas in host RAM), one job per module:

* :mod:`ninfer_kv.store.host_tier` — :class:`~ninfer_kv.store.host_tier.HostTier`, the tier of one
  store: placement, the replica rules, and its two state machines;
* :mod:`ninfer_kv.store.host_offload` — Device -> Host: :class:`~ninfer_kv.store.host_offload.HostOffload`
  and its :class:`OffloadPlan`;
* :mod:`ninfer_kv.store.host_restore` — Host -> Device: :class:`~ninfer_kv.store.host_restore.HostRestore`,
  Device replica drop and Host replica release;
* :mod:`ninfer_kv.store.transfer_records` — what both share: one pool's part of a transfer
  (:class:`~ninfer_kv.store.transfer_records.PoolTransfer`), its verification, the
  :class:`HostTransferReport` and the fault stages;
* :mod:`ninfer_kv.store.pool_host_replicas` — one pool's Host replica table
  (:class:`~ninfer_kv.store.pool_host_replicas.PoolHostReplicas`: extent memberships);
* :mod:`ninfer_kv.store.host_verbs` — the Host tier verbs of :class:`KVStore`.

The arena's bytes, extents, Host page layout and block copies are :mod:`ninfer_kv.host`'s; the
copies between device arrays and the arena are the device layer's
(:mod:`ninfer_kv.device.host_copies`, :mod:`ninfer_kv.device.host_staging`,
:mod:`ninfer_kv.device.offload_gather`).

The package imports no JAX.  Device states and the programs that change them
(:class:`~ninfer_kv.device.state.KVDeviceState`, :func:`~ninfer_kv.device.work.apply_work`, ...)
live in :mod:`ninfer_kv.device`.
"""

from __future__ import annotations

from .address_space import KVAddressSpace
from .bundle import CheckpointHandle, CheckpointInfo, SequenceHandle, SequenceKVBundle
from .entitlement import EntitlementPolicy, RoundGrant
from .host_offload import OffloadPlan
from .transfer_records import OFFLOAD_STAGES, RESTORE_STAGES, HostTransferReport
from .logical_page import LogicalKVPage
from .pool import DeviceKVPageLease, DevicePagePool
from .repair import ResyncReport
from .activation import ACTIVATION_STAGES
from .core import FaultInjector
from .store import KVStore
from .summary import HostOccupancy, HostPoolOccupancy, HostTransferStats, PoolOccupancy, StoreMemorySummary

__all__ = [
    "KVStore",
    "ResyncReport",
    "OffloadPlan",
    "ACTIVATION_STAGES",
    "FaultInjector",
    "DevicePagePool",
    "DeviceKVPageLease",
    "LogicalKVPage",
    "OFFLOAD_STAGES",
    "RESTORE_STAGES",
    "HostOccupancy",
    "HostPoolOccupancy",
    "HostTransferReport",
    "HostTransferStats",
    "KVAddressSpace",
    "SequenceKVBundle",
    "SequenceHandle",
    "CheckpointHandle",
    "CheckpointInfo",
    "EntitlementPolicy",
    "RoundGrant",
    "PoolOccupancy",
    "StoreMemorySummary",
]
