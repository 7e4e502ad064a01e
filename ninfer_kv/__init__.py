"""ninfer_kv: a growing, paged KV cache for JAX model step functions.

Host-side bookkeeping (typed page pools, logical pages, address spaces, reservations, block tables)
hands ``jax.jit`` step functions donated, stable-shape arrays; Pallas GPU kernels and C++ XLA FFI
CPU kernels append to and attend over page-major and head-major plane buffers in five closed KV
codecs.
"""

from .geometry import PAGE_SIZE, KVPageGeometry, PlaneOrder
from .layout import PagedKVStorageLayout, PlaneInventoryEntry, PoolMemorySummary
from .planning import (
    AutomaticCapacity,
    ExplicitCapacity,
    KVPlan,
    KVPoolSetLayout,
    ModelKVConfig,
    PoolKind,
    PoolPlan,
    SequenceCapacityCurve,
    SpeculativeBackend,
    SpeculativeConfig,
    plan_kv_cache,
)
from .profiles import KVCodec, KVProfile, PlaneSpec
from .views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView, PagedKVLayerView
from . import codecs, ops  # noqa: E402  (ops needs the views above)
from .host import HostKVArena, HostKVPageLayout
from .store import (
    CheckpointHandle,
    CheckpointInfo,
    DeviceKVPageLease,
    DevicePagePool,
    EntitlementError,
    EntitlementPolicy,
    HostCapacityError,
    IncompleteContinuationError,
    KVAddressSpace,
    KVStore,
    KVStoreError,
    LifecycleError,
    LogicalKVPage,
    PoolCapacityError,
    RoundGrant,
    SequenceHandle,
    SequenceKVBundle,
    StaleHandleError,
    StaleReplicaError,
)

__version__ = "0.1.0"

__all__ = [
    "PAGE_SIZE",
    "KVPageGeometry",
    "PlaneOrder",
    "PagedKVStorageLayout",
    "PlaneInventoryEntry",
    "PoolMemorySummary",
    "AutomaticCapacity",
    "ExplicitCapacity",
    "KVPlan",
    "KVPoolSetLayout",
    "ModelKVConfig",
    "PoolKind",
    "PoolPlan",
    "SequenceCapacityCurve",
    "SpeculativeBackend",
    "SpeculativeConfig",
    "plan_kv_cache",
    "KVCodec",
    "KVProfile",
    "PlaneSpec",
    "PagedKVLayerView",
    "PagedKVBatchLayerView",
    "CyclicKVCacheLayerView",
    "CyclicKVLayout",
    "codecs",
    "ops",
    "HostKVArena",
    "HostKVPageLayout",
    "KVStore",
    "EntitlementPolicy",
    "RoundGrant",
    "SequenceHandle",
    "CheckpointHandle",
    "CheckpointInfo",
    "SequenceKVBundle",
    "KVAddressSpace",
    "LogicalKVPage",
    "DevicePagePool",
    "DeviceKVPageLease",
    "KVStoreError",
    "StaleHandleError",
    "PoolCapacityError",
    "HostCapacityError",
    "EntitlementError",
    "LifecycleError",
    "IncompleteContinuationError",
    "StaleReplicaError",
]
