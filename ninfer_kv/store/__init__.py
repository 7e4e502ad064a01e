"""KV store: typed page pools, logical pages, address spaces, block tables and Host replicas.

Public entry points: :class:`KVStore` (host-only bookkeeping over every pool), its handles
(:class:`SequenceHandle`, :class:`CheckpointHandle`) and what its verbs report (infos, occupancy,
Host transfers, resync reports).  See ``docs/API.md`` ("## Store", "## Host tier") for the verbs.
The tables the store composes (address spaces, logical pages, block tables, execution rows) are
internals, importable from their own modules for tests and debugging.

The package is host-only: it imports no JAX.  Device states and the programs that change them
(:class:`~ninfer_kv.device.state.KVDeviceState`, :func:`~ninfer_kv.device.work.apply_work`, ...)
live in :mod:`ninfer_kv.device`.
"""

from __future__ import annotations

from .address_space import KVAddressSpace
from .bundle import CheckpointHandle, CheckpointInfo, SequenceHandle, SequenceKVBundle
from .entitlement import EntitlementPolicy, RoundGrant
from .host_offload import OffloadPlan
from .host_transfer import OFFLOAD_STAGES, RESTORE_STAGES, HostTransferReport
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
