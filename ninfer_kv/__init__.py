"""ninfer_kv: a growing, paged KV cache for JAX model step functions.

Host-side bookkeeping (typed page pools, logical pages, address spaces, reservations, block tables)
in :class:`KVStore` emits each round's device work as stable-shape arrays, which the caller applies
to its own :class:`KVDeviceState` with :func:`apply_work` inside its jitted step; Pallas GPU kernels and C++ XLA FFI
CPU kernels append to and attend over page-major and head-major plane buffers in five closed KV
profiles (BF16, INT8-G64, FP8-E4M3FN-row256, NVFP4-G16 and K8V4).

Importing the package imports nothing heavy: every name below is loaded from its module on first
use, so ``import ninfer_kv.store`` (host-only bookkeeping) never imports JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__  # noqa: F401  (the package version)

if TYPE_CHECKING:  # pragma: no cover  (the same names, for type checkers and readers)
    from . import codecs, ops
    from .geometry import KVPageGeometry, PAGE_SIZE, PlaneOrder, SENTINEL_PAGE
    from .layout import PagedKVStorageLayout, PlaneInventoryEntry, PoolMemorySummary
    from .planning import AutomaticCapacity, ExplicitCapacity, KVPlan, KVPoolSetLayout, MeshKVPlan, ModelKVConfig, PoolPlan, SequenceCapacityCurve, SpeculativeConfig, plan_kv_cache, plan_kv_cache_mesh
    from .kinds import PoolKind, SpeculativeBackend
    from .profiles import KVCodec, KVProfile, PlaneSpec
    from .views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView, PagedKVLayerView
    from .host import HostKVArena, HostKVPageLayout
    from .store import CheckpointHandle, CheckpointInfo, DeviceKVPageLease, DevicePagePool, EntitlementPolicy, KVAddressSpace, KVStore, LogicalKVPage, OffloadPlan, ResyncReport, RoundGrant, SequenceHandle, SequenceKVBundle
    from .device import KVDeviceState, KVMesh, apply_work, apply_work_jit, gather_pages, resync, take_step_work
    from .work import OffloadPayload, PendingWork, RoundWork, ShardedRoundWork, SyncStatus
    from .step_shapes import StepWorkShapes, step_work_shapes
    from .errors import DonatedStateError, EntitlementError, HostCapacityError, IncompleteContinuationError, KVStoreError, LifecycleError, LostContentError, PayloadError, PendingWorkError, PoolCapacityError, RowError, StaleHandleError, StaleReplicaError, TargetError, WorkOrderError
    from .mesh_spec import MeshSpec
    from .store.sharded import CrossShardError, ShardedCheckpoint, ShardedKVStore, ShardedSequence
    from .device.sharded_ops import sharded_apply_work, sharded_gather_pages, sharded_paged_append, sharded_paged_attention

_LAZY = {
    "PAGE_SIZE": "geometry",
    "KVPageGeometry": "geometry",
    "PlaneOrder": "geometry",
    "SENTINEL_PAGE": "geometry",
    "PagedKVStorageLayout": "layout",
    "PlaneInventoryEntry": "layout",
    "PoolMemorySummary": "layout",
    "AutomaticCapacity": "planning",
    "ExplicitCapacity": "planning",
    "KVPlan": "planning",
    "KVPoolSetLayout": "planning",
    "ModelKVConfig": "planning",
    "PoolPlan": "planning",
    "SequenceCapacityCurve": "planning",
    "SpeculativeConfig": "planning",
    "plan_kv_cache": "planning",
    "MeshKVPlan": "planning",
    "plan_kv_cache_mesh": "planning",
    "PoolKind": "kinds",
    "SpeculativeBackend": "kinds",
    "KVCodec": "profiles",
    "KVProfile": "profiles",
    "PlaneSpec": "profiles",
    "PagedKVLayerView": "views",
    "PagedKVBatchLayerView": "views",
    "CyclicKVCacheLayerView": "views",
    "CyclicKVLayout": "views",
    "HostKVArena": "host",
    "HostKVPageLayout": "host",
    "KVStore": "store",
    "OffloadPlan": "store",
    "ResyncReport": "store",
    "EntitlementPolicy": "store",
    "RoundGrant": "store",
    "SequenceHandle": "store",
    "CheckpointHandle": "store",
    "CheckpointInfo": "store",
    "SequenceKVBundle": "store",
    "KVAddressSpace": "store",
    "LogicalKVPage": "store",
    "DevicePagePool": "store",
    "DeviceKVPageLease": "store",
    "KVDeviceState": "device",
    "apply_work": "device",
    "apply_work_jit": "device",
    "gather_pages": "device",
    "take_step_work": "device",
    "resync": "device",
    "KVMesh": "device",
    "RoundWork": "work",
    "SyncStatus": "work",
    "OffloadPayload": "work",
    "PendingWork": "work",
    "ShardedRoundWork": "work",
    "step_work_shapes": "step_shapes",
    "StepWorkShapes": "step_shapes",
    "KVStoreError": "errors",
    "StaleHandleError": "errors",
    "PoolCapacityError": "errors",
    "HostCapacityError": "errors",
    "EntitlementError": "errors",
    "LifecycleError": "errors",
    "IncompleteContinuationError": "errors",
    "StaleReplicaError": "errors",
    "RowError": "errors",
    "WorkOrderError": "errors",
    "DonatedStateError": "errors",
    "PendingWorkError": "errors",
    "LostContentError": "errors",
    "PayloadError": "errors",
    "TargetError": "errors",
    "MeshSpec": "mesh_spec",
    "ShardedKVStore": "store.sharded",
    "ShardedSequence": "store.sharded",
    "ShardedCheckpoint": "store.sharded",
    "CrossShardError": "store.sharded",
    "sharded_apply_work": "device.sharded_ops",
    "sharded_gather_pages": "device.sharded_ops",
    "sharded_paged_append": "device.sharded_ops",
    "sharded_paged_attention": "device.sharded_ops",
}
_MODULES = ("codecs", "ops")

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
    "step_work_shapes",
    "StepWorkShapes",
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
    "PendingWorkError",
    "LostContentError",
    "PayloadError",
    "TargetError",
    "OffloadPayload",
    "PendingWork",
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


def __getattr__(name: str):
    """Load a public name from its module on first use (PEP 562)."""
    if name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY:
        module = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = module
    return module


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
