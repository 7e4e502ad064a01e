"""ninfer_kv: a growing, paged KV cache for JAX model step functions.

A jitted step over the cache is three calls: :func:`begin_step` (the store maps pages for the new
tokens and hands over its round work in an :class:`AttentionBatch`), the caller's step with one
:func:`attention` per layer (the state donated), and :func:`end_step` (commit).  Behind them,
Python bookkeeping in :class:`KVStore` (typed page pools, logical pages, address spaces,
reservations, block tables) emits each round's device work as stable-shape arrays, which
:func:`apply_work` applies to the caller's :class:`KVDeviceState`; Pallas kernels (GPU and TPU) and
C++ XLA FFI CPU kernels append to and attend over page-major and head-major plane buffers in five
closed KV profiles (BF16, INT8-G64, FP8-E4M3FN-row256, NVFP4-G16 and K8V4).

Importing the package imports nothing heavy: every name below is loaded from its module on first
use, so ``import ninfer_kv.store`` (host-only bookkeeping) never imports JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .schema.version import __version__  # noqa: F401  (the package version)

if TYPE_CHECKING:  # pragma: no cover  (the same names, for type checkers and readers)
    from . import ops
    from .device import (
        AttentionBatch,
        KVDeviceState,
        allocate_state,
        apply_work,
        attention,
        begin_step,
        end_step,
        resync,
        run_round,
        take_step_work,
    )
    from .schema.errors import KVStoreError
    from .schema.geometry import PAGE_SIZE
    from .schema.kinds import PoolKind
    from .schema.layout import PagedKVStorageLayout
    from .planning import ExplicitCapacity, KVPlan, ModelKVConfig, SpeculativeConfig, WindowRings, plan_kv_cache
    from .schema.profiles import KVProfile
    from .store import CheckpointHandle, KVStore, SequenceHandle
    from .ops.views import PagedKVBatchLayerView

_LAZY = {
    # plan
    "PAGE_SIZE": "schema.geometry",
    "ModelKVConfig": "planning",
    "ExplicitCapacity": "planning",
    "SpeculativeConfig": "planning",
    "WindowRings": "planning",
    "KVPlan": "planning",
    "plan_kv_cache": "planning",
    "PoolKind": "schema.kinds",
    "KVProfile": "schema.profiles",
    "PagedKVStorageLayout": "schema.layout",
    # the store and its handles
    "KVStore": "store",
    "SequenceHandle": "store",
    "CheckpointHandle": "store",
    "KVStoreError": "schema.errors",
    # the step API: a step in three calls
    "begin_step": "device",
    "attention": "device",
    "end_step": "device",
    "AttentionBatch": "device",
    # the device state and the full protocol of a step's round
    "KVDeviceState": "device",
    "allocate_state": "device",
    "apply_work": "device",
    "take_step_work": "device",
    "run_round": "device",
    "resync": "device",
    "PagedKVBatchLayerView": "ops.views",
}
_MODULES = ("ops",)

__all__ = [
    "PAGE_SIZE",
    "ModelKVConfig",
    "ExplicitCapacity",
    "SpeculativeConfig",
    "WindowRings",
    "KVPlan",
    "plan_kv_cache",
    "PoolKind",
    "KVProfile",
    "PagedKVStorageLayout",
    "KVStore",
    "SequenceHandle",
    "CheckpointHandle",
    "KVStoreError",
    "begin_step",
    "attention",
    "end_step",
    "AttentionBatch",
    "KVDeviceState",
    "allocate_state",
    "apply_work",
    "take_step_work",
    "run_round",
    "resync",
    "PagedKVBatchLayerView",
    "ops",
]
"""What a step author needs.  Everything else lives in a named submodule: :mod:`ninfer_kv.planning`
(plans, pool sets, capacity curves, mesh plans), :mod:`ninfer_kv.store` (the store's verbs, handles
and reports), :mod:`ninfer_kv.device` (device states, works, Host transfers, meshes),
:mod:`ninfer_kv.ops.views`, :mod:`ninfer_kv.schema.layout`, :mod:`ninfer_kv.host`, :mod:`ninfer_kv.schema.errors`,
:mod:`ninfer_kv.schema.round_work`, :mod:`ninfer_kv.engine`, :mod:`ninfer_kv.models`."""


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
