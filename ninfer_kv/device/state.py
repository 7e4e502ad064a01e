"""KVDeviceState: the device arrays of a KV store, owned by the caller.

The :class:`~ninfer_kv.store.KVStore` is host-only bookkeeping: it never holds a ``jax.Array``.
Everything that lives on the device sits in one :class:`KVDeviceState`, a frozen dataclass
registered as a JAX pytree, which the caller threads through its jitted steps (donated) and hands
to :func:`~ninfer_kv.apply_work` together with each :class:`~ninfer_kv.RoundWork` the store emits.

Pytree structure (explicit, so a sharded step can name a partition spec per leaf)::

    KVDeviceState
      planes:  {PoolKind: {plane name: stacked plane (layers, N, H, P, X) or (layers, H, N, P, X)}}
      tables:  {PoolKind: int32 (C, L) block-table matrix; SENTINEL_PAGE (-1) where no page is mapped}
      serial:  int32 ()    works applied in order so far; POISONED (-1) after an out-of-order work
      fault:   int32 (3,)  (-1, -1, -1) while healthy; after the first out-of-order work
                           (works applied before it, that work's serial, that work's store), or
                           (0, BLANK, 0) for a state allocated after works were taken
      owner:   int32 ()    the identity of the store whose works this state applies (0: not yet
                           bound; the first work in order binds it)
      page_axes: static ((PoolKind, page axis), ...)

``serial`` makes a skipped, repeated or reordered work detectable, and ``owner`` a work of another
store: :func:`apply_work` advances the serial only when the work's serial equals it and the work
comes from the state's store, and otherwise poisons the state, which then stays poisoned:
every later work writes nothing and every block-table entry holds the sentinel, so no op can read
or write a page until :func:`~ninfer_kv.resync` repairs the state.  ``fault`` keeps what the
repair needs to know: how far the state got before the slip.  The host compares both with
:meth:`KVStore.check_state`.

A state whose buffers were donated to a jitted step (or deleted) cannot be used again: flattening
it (any ``jax.jit`` call, ``jax.tree`` function or ``apply_work``) raises
:class:`~ninfer_kv.errors.DonatedStateError`, which names the fix: use the state the step
returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import DonatedStateError
from ..geometry import SENTINEL_PAGE
from ..kinds import PoolKind
from ..work import BLANK, POISONED, SyncStatus

__all__ = ["KVDeviceState", "POISONED", "BLANK", "SyncStatus", "check_live"]

_HEALTHY = (-1, -1, -1)


def check_live(state: "KVDeviceState") -> None:
    """Raise :class:`DonatedStateError` when ``state``'s buffers were donated or deleted.

    Every leaf of a state is donated together, so the ``serial`` scalar stands for all of them.
    Tracers (inside ``jit``) and abstract values are always live.
    """
    serial = state.serial
    if isinstance(serial, jax.Array) and not isinstance(serial, jax.core.Tracer) and serial.is_deleted():
        raise DonatedStateError(
            "this KVDeviceState was donated to a jitted step (or deleted): its buffers no longer exist. Use the "
            "state that step returned and thread it through every call (`state, out = step(state, ...)`); a state "
            "that was lost this way can be replaced with store.allocate_state() followed by ninfer_kv.resync(store, "
            "state)"
        )


@dataclasses.dataclass(frozen=True)
class KVDeviceState:
    """Device planes and block tables of every pool, plus the applied-work serial and fault record.

    Build it with :meth:`KVStore.allocate_state` (or :meth:`KVDeviceState.zeros`); advance it only
    through :func:`~ninfer_kv.apply_work` and the caller's own steps (which replace ``planes`` via
    :meth:`replace_planes`).  ``fault`` defaults to the healthy ``(-1, -1, -1)``, ``owner`` to 0
    (bound to the store of the first work applied in order).
    """

    planes: dict
    tables: dict
    serial: jax.Array
    page_axes: tuple = ()
    fault: Any = None
    owner: Any = None

    def __post_init__(self):
        if self.fault is None:
            object.__setattr__(self, "fault", _like_serial(self.serial, _HEALTHY))
        if self.owner is None:
            object.__setattr__(self, "owner", _like_serial(self.serial, 0))

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def zeros(cls, pools: Mapping, *, device=None, fill=None, blank: bool = False, owner: int = 0) -> "KVDeviceState":
        """A fresh state for ``pools = {PoolKind: PoolPlan}`` (a plan's ``pools``): zero (or
        ``fill``) planes, sentinel tables, serial 0, bound to store ``owner`` (0: the store of its
        first work).  ``blank=True`` marks it as holding none of the content of works already
        taken (:meth:`KVStore.allocate_state` after a take): poisoned until a
        :func:`~ninfer_kv.resync`."""
        planes, tables, axes = {}, {}, []
        put = (lambda x: jax.device_put(x, device)) if device is not None else (lambda x: x)
        for kind, pool_plan in pools.items():
            kind = PoolKind.parse(kind)
            planes[kind] = pool_plan.layout.allocate(pool_plan.physical_pages, device=device, fill=fill)
            tables[kind] = put(jnp.full((pool_plan.max_concurrency, pool_plan.logical_pages), SENTINEL_PAGE, jnp.int32))
            axes.append((kind, pool_plan.layout.order.page_axis))
        serial = put(jnp.asarray(POISONED if blank else 0, jnp.int32))
        fault = put(jnp.asarray((0, BLANK, 0) if blank else _HEALTHY, jnp.int32))
        owner = put(jnp.asarray(owner, jnp.int32))
        return cls(planes=planes, tables=tables, serial=serial, page_axes=tuple(axes), fault=fault, owner=owner)

    # -- views ---------------------------------------------------------------------------------------
    def page_axis(self, pool) -> int:
        """The axis of the physical page ID in ``pool``'s stacked planes (1 page-major, 2 head-major)."""
        kind = PoolKind.parse(pool)
        for k, axis in self.page_axes:
            if k is kind:
                return axis
        raise ValueError(f"pool {kind.value} is not in this state; pools: {[k.value for k, _ in self.page_axes]}")

    def pool_planes(self, pool) -> dict:
        """The planes of ``pool`` (a ``PoolKind`` or its name)."""
        self.page_axis(pool)
        check_live(self)
        return self.planes[PoolKind.parse(pool)]

    def table(self, pool) -> jax.Array:
        """The ``int32 (C, L)`` block-table matrix of ``pool``."""
        self.page_axis(pool)
        check_live(self)
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
        """A copy with the given fields replaced (``planes``, ``tables``, ``serial``, ``fault``, ``owner``)."""
        return dataclasses.replace(self, **changes)

    def host_serial(self) -> int:
        """``serial`` as a Python int (a device -> host read: it waits for the state)."""
        check_live(self)
        return int(np.asarray(_first_shard(self.serial)))

    def sync_status(self) -> SyncStatus:
        """``serial``, ``fault`` and ``owner`` read to the host in one transfer (waits for the state)."""
        check_live(self)
        serial, fault, owner = jax.device_get(
            (_first_shard(self.serial), _first_shard(self.fault), _first_shard(self.owner))
        )
        serial, reached, offending, store, owner = int(serial), int(fault[0]), int(fault[1]), int(fault[2]), int(owner)
        if offending == -1 and serial != POISONED:
            return SyncStatus(serial, False, None, owner)
        return SyncStatus(reached, True, offending, owner, None if offending == BLANK else store)


def _first_shard(x):
    """A replicated leaf's value (one addressable shard: works in multi-process programs)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


def _like_serial(serial, value):
    """``value`` as int32, placed like ``serial`` (concrete, abstract or traced)."""
    value = np.asarray(value, np.int32)
    if isinstance(serial, jax.core.Tracer) or not isinstance(serial, jax.Array):
        if isinstance(serial, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(value.shape, jnp.int32, sharding=getattr(serial, "sharding", None))
        return jnp.asarray(value)
    return jax.device_put(value, serial.sharding)


def _flatten_with_keys(state: KVDeviceState):
    check_live(state)
    keys = jax.tree_util.GetAttrKey
    children = (
        (keys("planes"), state.planes),
        (keys("tables"), state.tables),
        (keys("serial"), state.serial),
        (keys("fault"), state.fault),
        (keys("owner"), state.owner),
    )
    return children, state.page_axes


def _flatten(state: KVDeviceState):
    check_live(state)
    return (state.planes, state.tables, state.serial, state.fault, state.owner), state.page_axes


def _unflatten(page_axes, children) -> KVDeviceState:
    # not through __init__: a tree of other leaves (None, specs, layouts) keeps every field as given
    state = object.__new__(KVDeviceState)
    for name, value in zip(("planes", "tables", "serial", "fault", "owner"), children):
        object.__setattr__(state, name, value)
    object.__setattr__(state, "page_axes", page_axes)
    return state


jax.tree_util.register_pytree_with_keys(KVDeviceState, _flatten_with_keys, _unflatten, _flatten)
