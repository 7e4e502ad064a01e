"""The device programs of a :class:`~ninfer_kv.store.sharded.ShardedKVStore`.

The sharded store is host-only bookkeeping, like every store; what runs on the mesh lives here:
applying a stacked :class:`~ninfer_kv.schema.round_work.ShardedRoundWork` outside a step and gathering one
shard's offload payload per device.  :func:`~ninfer_kv.device.allocation.allocate_state`,
:func:`~ninfer_kv.device.rounds.take_step_work` and :func:`~ninfer_kv.device.offload_gather.gather_offload`
use them for a sharded store.

The store is taken by duck type (``kv_mesh``, ``identity``, ``work_serial``, ``global_pools()``,
``take_work()``, ``shards``, ``num_shards``): this module imports nothing of :mod:`ninfer_kv.store`.
"""

from __future__ import annotations

import weakref

import jax
import numpy as np

from ..schema.errors import LifecycleError
from ..schema.round_work import OffloadPayload
from .sharded_ops import sharded_apply_work, sharded_gather_pages
from .state import KVDeviceState

__all__ = ["apply_sharded_work_alone", "gather_sharded_offload"]

# One jitted "apply alone" program per store (its mesh closed over, the state donated); the entry
# goes with the store.
_APPLY_ALONE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _mesh_of(store):
    if store.kv_mesh is None:
        raise LifecycleError("this ShardedKVStore was built without a mesh; pass mesh= to use device programs")
    return store.kv_mesh


def apply_sharded_work_alone(store, state: KVDeviceState, work) -> KVDeviceState:
    """Apply a stacked work outside any step: one jitted program over the mesh, the state donated."""
    mesh = _mesh_of(store)
    program = _APPLY_ALONE.get(store)
    if program is None:
        program = jax.jit(lambda s, w: sharded_apply_work(mesh, s, w), donate_argnums=0)
        _APPLY_ALONE[store] = program
    if state.work_pending:  # the mark cleared on the host: one program with or without it
        state = state.replace(work_pending=False)
    return program(state, work.device_put(mesh))


def gather_sharded_offload(store, shard: int, plan, state: KVDeviceState) -> OffloadPayload:
    """Shard ``shard``'s offload payload for ``plan``: every device gathers its own pages and heads
    inside ``shard_map``; the pages then move to the host through the same specs in
    ``pinned_host`` memory on a GPU (directly on a CPU, where pinned host memory is ordinary
    memory).  Needs the shard's devices addressable by this process."""
    mesh = _mesh_of(store)
    serial = np.asarray(state.sync.addressable_data(0))[0]
    request = plan.request

    def payload_of(planes: dict) -> OffloadPayload:
        return OffloadPayload(request.store, request.token, serial, request.pages, planes)

    if not plan.pages:
        return payload_of({})
    stacked = {}
    for kind, ids in plan.pages.items():
        rows = np.zeros((store.num_shards, len(ids)), np.int32)
        rows[shard] = ids
        stacked[kind] = rows
    _, words = jax.jit(lambda s, p: sharded_gather_pages(mesh, s, p))(state, stacked)
    pinned = mesh.devices[0].platform in ("gpu", "cuda", "rocm")
    payload = {}
    for kind, planes in words.items():
        payload[kind] = {}
        for name, x in planes.items():
            if pinned:
                x = jax.device_put(x, mesh.sharding(x.sharding.spec, memory_kind="pinned_host"))
            if not x.is_fully_addressable:
                raise LifecycleError("a Host offload needs every device of the shard in this process")
            payload[kind][name] = np.asarray(x[shard])
    return payload_of(payload)
