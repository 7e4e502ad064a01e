"""KVDeviceState: the device arrays of a KV store, owned by the caller.

The :class:`~ninfer_kv.store.KVStore` is host-only bookkeeping: it never holds a ``jax.Array``.
Everything that lives on the device sits in one :class:`KVDeviceState`, a frozen dataclass
registered as a JAX pytree, which the caller threads through its jitted steps (donated) and hands
to :func:`~ninfer_kv.apply_work` together with each :class:`~ninfer_kv.RoundWork` the store emits.

Pytree structure (explicit, so a later sharded step can name a partition spec per leaf)::

    KVDeviceState
      planes:  {PoolKind: {plane name: stacked plane (layers, N, H, P, X) or (layers, H, N, P, X)}}
      tables:  {PoolKind: int32 (C, L) block-table matrix}
      serial:  int32 ()    works applied so far; POISONED (-1) after an out-of-order work
      page_axes: static ((PoolKind, page axis), ...)

``serial`` makes a skipped or repeated work detectable: :func:`apply_work` advances it only when
the work's serial equals it and otherwise sets it to :data:`POISONED`, where it stays; the host
compares it with :meth:`KVStore.check_state`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..planning import PoolKind

__all__ = ["KVDeviceState", "POISONED"]

POISONED = -1
"""``KVDeviceState.serial`` after a work was applied out of order (sticky)."""


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["planes", "tables", "serial"], meta_fields=["page_axes"]
)
@dataclasses.dataclass(frozen=True)
class KVDeviceState:
    """Device planes and block tables of every pool, plus the applied-work serial.

    Build it with :meth:`KVStore.allocate_state` (or :meth:`KVDeviceState.zeros`); advance it only
    through :func:`~ninfer_kv.apply_work` and the caller's own steps (which replace ``planes`` via
    :meth:`replace_planes`).
    """

    planes: dict
    tables: dict
    serial: jax.Array
    page_axes: tuple = ()

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def zeros(cls, pools: Mapping, *, device=None, fill=None) -> "KVDeviceState":
        """A fresh state for ``pools = {PoolKind: PoolPlan}`` (a plan's ``pools``): zero (or
        ``fill``) planes, sentinel tables, serial 0."""
        planes, tables, axes = {}, {}, []
        for kind, pool_plan in pools.items():
            kind = PoolKind.parse(kind)
            planes[kind] = pool_plan.layout.allocate(pool_plan.physical_pages, device=device, fill=fill)
            table = jnp.zeros((pool_plan.max_concurrency, pool_plan.logical_pages), jnp.int32)
            tables[kind] = jax.device_put(table, device) if device is not None else table
            axes.append((kind, pool_plan.layout.order.page_axis))
        serial = jnp.zeros((), jnp.int32)
        if device is not None:
            serial = jax.device_put(serial, device)
        return cls(planes=planes, tables=tables, serial=serial, page_axes=tuple(axes))

    # -- views ---------------------------------------------------------------------------------------
    def page_axis(self, pool) -> int:
        kind = PoolKind.parse(pool)
        for k, axis in self.page_axes:
            if k is kind:
                return axis
        raise ValueError(f"pool {kind.value} is not in this state; pools: {[k.value for k, _ in self.page_axes]}")

    def pool_planes(self, pool) -> dict:
        """The planes of ``pool`` (a ``PoolKind`` or its name)."""
        self.page_axis(pool)
        return self.planes[PoolKind.parse(pool)]

    def table(self, pool) -> jax.Array:
        """The ``int32 (C, L)`` block-table matrix of ``pool``."""
        self.page_axis(pool)
        return self.tables[PoolKind.parse(pool)]

    def replace_planes(self, pool, planes: Mapping) -> "KVDeviceState":
        """A state whose ``pool`` planes are ``planes`` (e.g. a step's donated-and-returned planes).

        Keys, shapes and dtypes must match (checked on the host; free under ``jit``).
        """
        kind = PoolKind.parse(pool)
        current = self.pool_planes(kind)
        if set(planes) != set(current):
            raise ValueError(f"pool {kind.value}: planes {sorted(planes)} != {sorted(current)}")
        for name, arr in planes.items():
            old = current[name]
            if tuple(arr.shape) != tuple(old.shape) or arr.dtype != old.dtype:
                raise ValueError(
                    f"pool {kind.value}: plane {name!r} is {tuple(arr.shape)} {arr.dtype}, needs "
                    f"{tuple(old.shape)} {old.dtype}"
                )
        return dataclasses.replace(self, planes={**self.planes, kind: dict(planes)})

    def replace(self, **changes) -> "KVDeviceState":
        return dataclasses.replace(self, **changes)

    def host_serial(self) -> int:
        """``serial`` as a Python int (a device -> host read: it waits for the state)."""
        return int(np.asarray(self.serial))
