"""KV store: typed page pools, logical pages, address spaces, block tables and Host replicas.

Public entry points: :class:`KVStore` (host-only bookkeeping), :class:`KVDeviceState` (the
caller-owned device arrays) and :func:`apply_work` (the pure function that applies a store's
:class:`RoundWork` to a state).  See ``docs/API.md`` ("## Store", "## Host tier") for the verbs.

The package is host-only: importing it imports no JAX.  The device names it re-exports
(:class:`KVDeviceState`, :func:`apply_work`, :func:`apply_work_jit`, :func:`gather_pages`,
:func:`resync`, :func:`take_step_work`) live in :mod:`ninfer_kv.device` and are loaded on first use.
"""

from __future__ import annotations

from .address_space import AddressSpaceTable, KVAddressSpace
from ..geometry import SENTINEL_PAGE
from ..step_shapes import StepWorkShapes, step_work_shape, step_work_shapes
from ..work import BLANK, POISONED, GatherRequest, OffloadPayload, PendingWork, PoolWork, RoundWork, SyncStatus
from .block_tables import PUBLISH_BUCKETS, BlockTableMatrix
from .bundle import CheckpointHandle, CheckpointInfo, SequenceHandle, SequenceKVBundle
from .entitlement import EntitlementPolicy, RoundGrant
from ..errors import (
    EntitlementError,
    HostCapacityError,
    StaleReplicaError,
    IncompleteContinuationError,
    InvariantError,
    KVStoreError,
    LifecycleError,
    PoolCapacityError,
    RowError,
    StaleHandleError,
    WorkOrderError,
    DonatedStateError,
    LostContentError,
    PayloadError,
    TargetError,
)
from .frontier_history import FrontierHistory
from .host_replicas import OFFLOAD_STAGES, RESTORE_STAGES, HostTransferReport, OffloadPlan
from .logical_page import HostReplica, LogicalKVPage, LogicalPageTable, ReplicaRef, replica_valid
from .pool import DeviceKVPageLease, DevicePagePool
from .repair import ResyncReport
from .rows import ExecutionRows
from .store import ACTIVATION_STAGES, FaultInjector, KVStore
from .summary import HostOccupancy, HostPoolOccupancy, HostTransferStats, PoolOccupancy, StoreMemorySummary

__all__ = [
    "KVStore",
    "KVDeviceState",
    "POISONED",
    "BLANK",
    "SyncStatus",
    "SENTINEL_PAGE",
    "resync",
    "ResyncReport",
    "FrontierHistory",
    "RoundWork",
    "PoolWork",
    "apply_work",
    "apply_work_jit",
    "gather_pages",
    "step_work_shape",
    "step_work_shapes",
    "StepWorkShapes",
    "take_step_work",
    "OffloadPlan",
    "ExecutionRows",
    "ACTIVATION_STAGES",
    "FaultInjector",
    "DevicePagePool",
    "DeviceKVPageLease",
    "LogicalKVPage",
    "LogicalPageTable",
    "ReplicaRef",
    "HostReplica",
    "replica_valid",
    "OFFLOAD_STAGES",
    "RESTORE_STAGES",
    "HostOccupancy",
    "HostPoolOccupancy",
    "HostTransferReport",
    "HostTransferStats",
    "KVAddressSpace",
    "AddressSpaceTable",
    "SequenceKVBundle",
    "SequenceHandle",
    "CheckpointHandle",
    "CheckpointInfo",
    "EntitlementPolicy",
    "RoundGrant",
    "BlockTableMatrix",
    "PUBLISH_BUCKETS",
    "PoolOccupancy",
    "StoreMemorySummary",
    "KVStoreError",
    "StaleHandleError",
    "PoolCapacityError",
    "EntitlementError",
    "LifecycleError",
    "IncompleteContinuationError",
    "InvariantError",
    "HostCapacityError",
    "StaleReplicaError",
    "RowError",
    "WorkOrderError",
    "DonatedStateError",
    "LostContentError",
    "PayloadError",
    "TargetError",
    "PendingWork",
    "GatherRequest",
    "OffloadPayload",
]

_DEVICE_NAMES = ("KVDeviceState", "apply_work", "apply_work_jit", "gather_pages", "resync", "take_step_work")


def __getattr__(name: str):
    """The device-layer names, loaded on first use (the store itself never imports JAX)."""
    if name in _DEVICE_NAMES:
        from .. import device

        return getattr(device, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
