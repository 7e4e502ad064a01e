"""KVDeviceState: the device arrays of a KV store, owned by the caller.

The :class:`~ninfer_kv.store.KVStore` is host-only bookkeeping: it never holds a ``jax.Array``.
Everything that lives on the device sits in one :class:`KVDeviceState`, a frozen dataclass
registered as a JAX pytree, which the caller threads through its jitted steps (donated) and hands
to :func:`~ninfer_kv.apply_work` together with each :class:`~ninfer_kv.RoundWork` the store emits.

Pytree structure (explicit, so a sharded step can name a partition spec per leaf)::

    KVDeviceState
      planes:  {PoolKind: {plane name: stacked plane (layers, N, H, P, X) or (layers, H, N, P, X)}}
      tables:  {PoolKind: int32 (C, L) block-table matrix; SENTINEL_PAGE (-1) where no page is mapped}
      sync:    int32 (5,)  the order record, read through three properties:
        serial = sync[0]     works applied in order so far; POISONED (-1) after an out-of-order work
        fault  = sync[1:4]   (-1, -1, -1) while healthy; after the first out-of-order work
                             (works applied before it, that work's serial, that work's store), or
                             (0, BLANK, 0) for a state allocated after works were taken
        owner  = sync[4]     the identity of the store whose works this state applies (0: not yet
                             bound; the first work in order binds it)
      page_axes: static ((PoolKind, page axis), ...)

The order record is one array so that a step carries one small buffer for it, not three (every
buffer of a jitted call costs a CPU decode step microseconds); inside ``jit`` the properties are
slices, and :meth:`KVDeviceState.sync_status` reads the record to the host in one transfer.

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

__all__ = ["KVDeviceState", "POISONED", "BLANK", "SyncStatus", "check_live", "sync_record"]

_HEALTHY = (-1, -1, -1)


def check_live(state: "KVDeviceState") -> None:
    """Raise :class:`DonatedStateError` when ``state``'s buffers were donated or deleted.

    Every leaf of a state is donated together, so the ``sync`` record stands for all of them.
    Tracers (inside ``jit``) and abstract values are always live.
    """
    sync = state.sync
    if isinstance(sync, jax.Array) and not isinstance(sync, jax.core.Tracer) and sync.is_deleted():
        raise DonatedStateError(
            "this KVDeviceState was donated to a jitted step (or deleted): its buffers no longer exist. Use the "
            "state that step returned and thread it through every call (`state, out = step(state, ...)`); a state "
            "that was lost this way can be replaced with store.allocate_state() followed by ninfer_kv.resync(store, "
            "state)"
        )


def sync_record(serial: int, fault=_HEALTHY, owner: int = 0) -> np.ndarray:
    """The ``int32 (5,)`` order record ``(serial, *fault, owner)`` of host values."""
    return np.array([int(serial), *(int(f) for f in np.asarray(fault).reshape(3)), int(owner)], np.int32)


@dataclasses.dataclass(frozen=True, init=False)
class KVDeviceState:
    """Device planes and block tables of every pool, plus the order record: the applied-work
    serial, the fault record and the owning store in one ``int32 (5,)`` array (:attr:`sync`; read
    it through :attr:`serial`, :attr:`fault` and :attr:`owner`).

    Build it with :meth:`KVStore.allocate_state` (or :meth:`KVDeviceState.zeros`); advance it only
    through :func:`~ninfer_kv.apply_work` and the caller's own steps (which replace ``planes`` via
    :meth:`replace_planes`).  Built by hand it takes ``sync``, or ``serial`` with ``fault``
    (default the healthy ``(-1, -1, -1)``) and ``owner`` (default 0: bound to the store of the
    first work applied in order).
    """

    planes: dict
    tables: dict
    sync: Any
    page_axes: tuple = ()

    def __init__(self, planes: dict, tables: dict, serial=None, page_axes: tuple = (), fault=None, owner=None, *,
                 sync=None):
        if sync is None:
            if serial is None:
                raise TypeError("KVDeviceState needs sync (the int32 (5,) order record) or serial")
            sync = _record_like(serial, fault, owner)
        elif serial is not None or fault is not None or owner is not None:
            raise TypeError("pass either sync or serial/fault/owner, not both")
        object.__setattr__(self, "planes", planes)
        object.__setattr__(self, "tables", tables)
        object.__setattr__(self, "sync", sync)
        object.__setattr__(self, "page_axes", tuple(page_axes))

    # -- the order record ----------------------------------------------------------------------------
    @property
    def serial(self) -> jax.Array:
        """``int32 ()``: works applied in order so far (``POISONED`` after an out-of-order work)."""
        return self.sync[0]

    @property
    def fault(self) -> jax.Array:
        """``int32 (3,)``: ``(-1, -1, -1)`` while healthy, else what the first slip left (module docstring)."""
        return self.sync[1:4]

    @property
    def owner(self) -> jax.Array:
        """``int32 ()``: the identity of the store whose works this state applies (0: not bound yet)."""
        return self.sync[4]

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
        record = sync_record(POISONED, (0, BLANK, 0), owner) if blank else sync_record(0, _HEALTHY, owner)
        return cls(planes, tables, page_axes=tuple(axes), sync=put(jnp.asarray(record)))

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
        """A copy with the given fields replaced (``planes``, ``tables``, ``sync``, ``page_axes``;
        ``serial``, ``fault`` and ``owner`` rebuild the order record, the parts not named kept)."""
        parts = {name: changes.pop(name) for name in ("serial", "fault", "owner") if name in changes}
        if parts:
            if "sync" in changes:
                raise TypeError("pass either sync or serial/fault/owner, not both")
            if isinstance(self.sync, jax.sharding.PartitionSpec):  # a state of partition specs
                changes["sync"] = parts.get("serial", self.sync)
            else:
                changes["sync"] = _record_like(
                    parts.get("serial", self.serial), parts.get("fault", self.fault), parts.get("owner", self.owner),
                    like=self.sync,
                )
        return dataclasses.replace(self, **changes)

    def host_serial(self) -> int:
        """``serial`` as a Python int (a device -> host read: it waits for the state)."""
        return self._host_record()[0]

    def sync_status(self) -> SyncStatus:
        """``serial``, ``fault`` and ``owner`` read to the host in one transfer (waits for the state)."""
        serial, reached, offending, store, owner = self._host_record()
        if offending == -1 and serial != POISONED:
            return SyncStatus(serial, False, None, owner)
        return SyncStatus(reached, True, offending, owner, None if offending == BLANK else store)

    def _host_record(self) -> list[int]:
        check_live(self)
        return [int(x) for x in np.asarray(jax.device_get(_first_shard(self.sync))).reshape(5)]


def _first_shard(x):
    """A replicated leaf's value (one addressable shard: works in multi-process programs)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


def _record_like(serial, fault=None, owner=None, like=None):
    """The order record of ``serial``, ``fault`` (default healthy) and ``owner`` (default 0).

    Traced parts make a traced record; abstract ones (``jax.ShapeDtypeStruct``) an abstract
    record; host or device values a device array placed like ``like`` (default ``serial``).
    """
    fault = _HEALTHY if fault is None else fault
    owner = 0 if owner is None else owner
    parts = (serial, fault, owner)
    ref = serial if like is None else like
    if isinstance(ref, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((5,), jnp.int32, sharding=getattr(ref, "sharding", None))
    if any(isinstance(x, jax.core.Tracer) for x in parts):
        return jnp.concatenate([jnp.reshape(jnp.asarray(x, jnp.int32), (-1,)) for x in parts])
    record = sync_record(*(np.asarray(jax.device_get(_first_shard(x))) for x in parts))
    if isinstance(ref, jax.Array):
        return jax.device_put(record, ref.sharding)
    return jnp.asarray(record)


def _flatten_with_keys(state: KVDeviceState):
    check_live(state)
    keys = jax.tree_util.GetAttrKey
    children = ((keys("planes"), state.planes), (keys("tables"), state.tables), (keys("sync"), state.sync))
    return children, state.page_axes


def _flatten(state: KVDeviceState):
    check_live(state)
    return (state.planes, state.tables, state.sync), state.page_axes


def _unflatten(page_axes, children) -> KVDeviceState:
    # not through __init__: a tree of other leaves (None, specs, layouts) keeps every field as given
    state = object.__new__(KVDeviceState)
    for name, value in zip(("planes", "tables", "sync"), children):
        object.__setattr__(state, name, value)
    object.__setattr__(state, "page_axes", page_axes)
    return state


jax.tree_util.register_pytree_with_keys(KVDeviceState, _flatten_with_keys, _unflatten, _flatten)
