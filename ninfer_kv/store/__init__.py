"""KV store: typed page pools, logical pages, address spaces, block tables and Host replicas.

Public entry point: :class:`KVStore`.  See ``docs/API.md`` ("## Store", "## Host tier") for the verbs.
"""

from .address_space import AddressSpaceTable, KVAddressSpace
from .block_tables import PUBLISH_BUCKETS, BlockTableMatrix, publish_table_updates
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
)
from .host_replicas import OFFLOAD_STAGES, RESTORE_STAGES, HostTransferReport
from .logical_page import HostReplica, LogicalKVPage, LogicalPageTable, ReplicaRef, replica_valid
from .pool import DeviceKVPageLease, DevicePagePool
from .store import ACTIVATION_STAGES, FaultInjector, KVStore
from .summary import HostOccupancy, HostPoolOccupancy, HostTransferStats, PoolOccupancy, StoreMemorySummary

__all__ = [
    "KVStore",
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
    "publish_table_updates",
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
]
