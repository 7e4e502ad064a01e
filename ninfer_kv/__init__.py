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
]
