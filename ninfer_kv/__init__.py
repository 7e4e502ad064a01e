"""ninfer_kv: a growing, paged KV cache for JAX model step functions.

Host-side bookkeeping (typed page pools, logical pages, address spaces, reservations, block tables)
in :class:`KVStore` emits each round's device work as stable-shape arrays, which the caller applies
to its own :class:`KVDeviceState` with :func:`apply_work` inside its jitted step; Pallas GPU kernels and C++ XLA FFI
CPU kernels append to and attend over page-major and head-major plane buffers in five closed KV
profiles (BF16, INT8-G64, FP8-E4M3FN-row256, NVFP4-G16 and K8V4).
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
    KVDeviceState,
    KVStore,
    KVStoreError,
    LifecycleError,
    LogicalKVPage,
    OffloadPlan,
    PoolCapacityError,
    RoundGrant,
    RoundWork,
    RowError,
    SequenceHandle,
    SequenceKVBundle,
    StaleHandleError,
    StaleReplicaError,
    WorkOrderError,
    DonatedStateError,
    LostContentError,
    ResyncReport,
    SENTINEL_PAGE,
    SyncStatus,
    apply_work,
    apply_work_jit,
    gather_pages,
    resync,
    take_step_work,
)

from .mesh import KVMesh, MeshSpec
from .planning import MeshKVPlan, plan_kv_cache_mesh
from .store.sharded import CrossShardError, ShardedCheckpoint, ShardedKVStore, ShardedRoundWork, ShardedSequence
from .sharded_ops import (
    sharded_apply_work,
    sharded_gather_pages,
    sharded_paged_append,
    sharded_paged_attention,
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
    "KVDeviceState",
    "RoundWork",
    "OffloadPlan",
    "apply_work",
    "apply_work_jit",
    "gather_pages",
    "take_step_work",
    "resync",
    "ResyncReport",
    "SyncStatus",
    "SENTINEL_PAGE",
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
    "RowError",
    "WorkOrderError",
    "DonatedStateError",
    "LostContentError",
    "MeshSpec",
    "KVMesh",
    "MeshKVPlan",
    "plan_kv_cache_mesh",
    "ShardedKVStore",
    "ShardedRoundWork",
    "ShardedSequence",
    "ShardedCheckpoint",
    "CrossShardError",
    "sharded_apply_work",
    "sharded_gather_pages",
    "sharded_paged_append",
    "sharded_paged_attention",
]
