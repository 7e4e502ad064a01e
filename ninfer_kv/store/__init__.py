"""Device-tier KV store: typed page pools, logical pages, address spaces and block tables.

Public entry point: :class:`KVStore`.  See ``docs/API.md`` ("## Store") for the verbs.
"""

from .address_space import AddressSpaceTable, KVAddressSpace
from .block_tables import PUBLISH_BUCKETS, BlockTableMatrix, publish_table_updates
from .bundle import CheckpointHandle, CheckpointInfo, SequenceHandle, SequenceKVBundle
from .entitlement import EntitlementPolicy, RoundGrant
from .errors import (
    EntitlementError,
    IncompleteContinuationError,
    InvariantError,
    KVStoreError,
    LifecycleError,
    PoolCapacityError,
    StaleHandleError,
)
from .logical_page import LogicalKVPage, LogicalPageTable, ReplicaRef, replica_valid
from .pool import DeviceKVPageLease, DevicePagePool
from .store import ACTIVATION_STAGES, FaultInjector, KVStore
from .summary import PoolOccupancy, StoreMemorySummary

__all__ = [
    "KVStore",
    "ACTIVATION_STAGES",
    "FaultInjector",
    "DevicePagePool",
    "DeviceKVPageLease",
    "LogicalKVPage",
    "LogicalPageTable",
    "ReplicaRef",
    "replica_valid",
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
]
