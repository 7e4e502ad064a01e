"""Allocating device buffers: a plan's pools, a store's device state.

Planning (:mod:`ninfer_kv.planning`) and layouts (:mod:`ninfer_kv.schema.layout`) are arithmetic: they say
how many pages each pool has and which shapes and dtypes its planes take.  Turning that into
``jax.Array`` buffers is device work: one layout's planes are
:func:`~ninfer_kv.ops.views.allocate_planes`; a plan's pools and a store's device state live here
(:func:`allocate_state`): the store is host-only and is taken by duck type (``pool_plans``,
``work_serial``, ``identity``, ``device``; a sharded store also ``kv_mesh``).
"""

from __future__ import annotations

import jax

from ..ops.views import allocate_planes
from .sharded_store import _mesh_of
from .state import KVDeviceState

__all__ = ["allocate_pools", "allocated_pool_bytes", "allocate_state"]


def allocate_pools(pool_set, m: int, *, device=None) -> dict:
    """``{PoolKind: {plane name: jax.Array}}``: every pool's planes of ``pool_set`` (a
    :class:`~ninfer_kv.planning.KVPoolSetLayout`) at ``M = m``, zero-filled, on ``device`` when
    given (block tables are the store's)."""
    pool_set.check_bounds(pool_set.check_m(m))
    return {kind: allocate_planes(p.layout, p.physical_pages, device=device) for kind, p in pool_set.pools(m).items()}


def allocated_pool_bytes(pool_set, m: int) -> int:
    """Bytes of really allocated planes (:func:`allocate_pools` and the window rings) plus block tables
    and the fixed part at ``M = m``: what the capacity curve's ``B(m)`` must equal (the buffers are freed)."""
    total = 0
    for planes in allocate_pools(pool_set, m).values():
        total += sum(int(a.nbytes) for a in planes.values())
        del planes
    if pool_set.rings is not None:
        rings = allocate_planes(pool_set.rings.layout, pool_set.rings.physical_pages)
        total += sum(int(a.nbytes) for a in rings.values())
        del rings
    return total + sum(p.table_bytes for p in pool_set.pools(m).values()) + pool_set.fixed_bytes


def allocate_state(store, *, device=None, fill=None, memory_kind: str | None = None) -> KVDeviceState:
    """A fresh :class:`~ninfer_kv.device.state.KVDeviceState` for ``store``: zero (or ``fill``)
    planes, sentinel tables, serial 0, on ``device`` (default: the store's).

    After works were taken the fresh state holds none of their content: it is returned *blank*
    (poisoned: every op over it is dropped) and :func:`~ninfer_kv.resync` brings it in line —
    restoring what Host replicas hold (a Host-only checkpoint stays intact) and quarantining what
    is gone.  That is the way back from a state lost to a failed donated step.

    A :class:`~ninfer_kv.store.sharded.ShardedKVStore` gets a sharded state on its mesh, each device
    allocating only its own block (planes ``P(None, data, model)`` / ``P(None, model, data)``,
    tables ``P(data)``, serial replicated); there ``memory_kind="pinned_host"`` places the same specs
    in pinned host memory (a Host-tier copy) and ``device`` is refused (the mesh places it).
    """
    if hasattr(store, "kv_mesh"):
        if device is not None:
            raise ValueError("a sharded store's state lives on its mesh: pass no device (memory_kind= is allowed)")
        return _allocate_sharded(store, fill, memory_kind)
    if memory_kind is not None:
        raise ValueError(f"memory_kind={memory_kind!r} is for a sharded store's state; pass device= here")
    return KVDeviceState.zeros(
        store.pool_plans,
        device=device if device is not None else store.device,
        fill=fill,
        blank=store.work_serial > 0,
        owner=store.identity,
        ring=store.pool_set.rings,
    )


def _allocate_sharded(store, fill, memory_kind: str | None) -> KVDeviceState:
    mesh = _mesh_of(store)
    pools = store.global_pools()
    blank = store.work_serial > 0  # a state allocated after takes holds none of their content

    def build():
        return KVDeviceState.zeros(pools, fill=fill, blank=blank, owner=store.identity)

    shardings = mesh.state_shardings(jax.eval_shape(build), memory_kind=memory_kind)
    return jax.jit(build, out_shardings=shardings)()
