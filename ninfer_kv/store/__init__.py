"""KV store: typed page pools, logical pages, address spaces, block tables and Host replicas.

Public entry points: :class:`KVStore` (host-only bookkeeping), :class:`KVDeviceState` (the
caller-owned device arrays) and :func:`apply_work` (the pure function that applies a store's
:class:`RoundWork` to a state).  See ``docs/API.md`` ("## Store", "## Host tier") for the verbs.
"""

from .address_space import AddressSpaceTable, KVAddressSpace
from .block_tables import PUBLISH_BUCKETS, SENTINEL_PAGE, BlockTableMatrix
from .device_state import BLANK, POISONED, KVDeviceState, SyncStatus
from .bundle import CheckpointHandle, CheckpointInfo, SequenceHandle, SequenceKVBundle
from .entitlement import EntitlementPolicy, RoundGrant
from .errors import (
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
from .round_work import (
    PoolWork,
    RoundWork,
    apply_work,
    apply_work_jit,
    gather_pages,
    GatherRequest,
    OffloadPayload,
    PendingWork,
    resync,
    step_work_shape,
    step_work_shapes,
    StepWorkShapes,
    take_step_work,
)
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
