"""The device side of an offload: a checkpoint's pages gathered from a device state for the Host tier.

The store plans an offload and completes it (:meth:`~ninfer_kv.store.KVStore.plan_offload`,
:meth:`~ninfer_kv.store.KVStore.complete_offload`: Python bookkeeping); reading the pages out
of a :class:`~ninfer_kv.device.state.KVDeviceState` is device work and lives here.  The store is
taken by duck type (``plan_offload``, ``complete_offload``, ``cancel_offload``,
``gather_offload_from_host``, ``host_arena``; a sharded store also ``kv_mesh``, ``shards``,
``locate``, ``locate_shard``): this module imports nothing of :mod:`ninfer_kv.store`.
"""

from __future__ import annotations

import dataclasses

from ..schema.errors import LifecycleError
from ..schema.round_work import OffloadPayload
from .sharded_store import gather_sharded_offload
from .host_staging import start_to_host
from .state import KVDeviceState
from .work import gather_pages_jit

__all__ = ["gather_offload", "offload_checkpoint"]


def _host_addressable(state: KVDeviceState) -> bool:
    """Whether every plane of ``state`` is one array on one CPU device (numpy reads it in place)."""
    for planes in state.planes.values():
        for x in planes.values():
            found = x.devices()
            if len(found) != 1 or next(iter(found)).platform != "cpu":
                return False
    return True


def gather_offload(store, plan, state: KVDeviceState, *, shard: int | None = None) -> OffloadPayload:
    """The :class:`~ninfer_kv.schema.round_work.OffloadPayload` of ``plan`` (from ``store.plan_offload``)
    gathered from ``state``, for ``store.complete_offload``.

    Where the state's planes are host memory (one CPU device) the pages are copied straight from
    them into the plan's extents, once (``store.gather_offload_from_host``); elsewhere a jitted
    :func:`~ninfer_kv.device.work.gather_pages` of ``plan.request`` gathers them on the device and
    the Device -> Host copy starts through the arena's staging memory
    (:mod:`ninfer_kv.device.host_staging`).  On a sharded store, ``shard`` names the data shard whose
    store made the plan, and every device gathers its own pages and heads of it inside
    ``shard_map`` (:func:`~ninfer_kv.device.sharded_store.gather_sharded_offload`).
    """
    if hasattr(store, "kv_mesh"):
        if shard is None:
            raise ValueError("a sharded store's offload needs shard= (the data shard whose store made the plan)")
        return gather_sharded_offload(store, store.locate_shard(shard), plan, state)
    if shard is not None:
        raise ValueError(f"shard={shard!r} is for a sharded store; this store has one shard")
    if store.host_arena is None:
        raise LifecycleError("gather_offload needs a Host tier; build the store with host_arena= or host_bytes=")
    if _host_addressable(state):
        return store.gather_offload_from_host(plan, state.planes, state.host_serial())
    payload = gather_pages_jit(state, plan.request)
    arena = store.host_arena
    planes = {k: {n: start_to_host(arena, x) for n, x in p.items()} for k, p in payload.planes.items()}
    return dataclasses.replace(payload, planes=planes)


def offload_checkpoint(store, handle, state: KVDeviceState):
    """Plan, gather from ``state`` and complete the Host offload of a retained checkpoint in one
    call; rolled back fully (the plan cancelled) on any failure.  ``state`` must have applied
    every round work taken so far (when a pending work touches the pages, take and apply it
    first).  Returns the store's (on a sharded store: the checkpoint's shard's)
    :class:`~ninfer_kv.store.transfer_records.HostTransferReport`."""
    owner, shard = store, None
    if hasattr(store, "kv_mesh"):
        shard, handle = store.locate(handle)
        owner = store.shards[shard]
    plan = owner.plan_offload(handle)
    try:
        payload = gather_offload(store, plan, state, shard=shard)
    except BaseException:
        owner.cancel_offload(plan)
        raise
    return owner.complete_offload(plan, payload)
