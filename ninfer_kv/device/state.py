"""KVDeviceState: the device arrays of a KV store, owned by the caller.

The :class:`~ninfer_kv.store.KVStore` is host-only bookkeeping: it never holds a ``jax.Array``.
Everything that lives on the device sits in one :class:`KVDeviceState`, a frozen dataclass
registered as a JAX pytree, which the caller threads through its jitted steps (donated) and hands
to :func:`~ninfer_kv.apply_work` together with each :class:`~ninfer_kv.schema.round_work.RoundWork` the store emits.

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
      layouts: static ((PoolKind, PagedKVStorageLayout), ...): each pool's layout (page axis, views)
      rings:   {plane name: stacked plane (layers, C * k, H, P, X)}: the window rings of a model's
               sliding-window layers ({} without; :mod:`ninfer_kv.planning.rings`)
      ring:    static RingPlan or None: the rings' layout and pages per row

The order record is one array so that a step carries one small buffer for it, not three (every
buffer of a jitted call costs a CPU decode step microseconds); inside ``jit`` the properties are
slices, and :meth:`KVDeviceState.sync_status` reads the record to the host in one transfer.

``serial`` makes a skipped, repeated or reordered work detectable, and ``owner`` a work of another
store: :func:`apply_work` advances the serial only when the work's serial equals it and the work
comes from the state's store, and otherwise poisons the state, which then stays poisoned:
every later work writes nothing and every block-table entry holds the sentinel, so no op can read
or write a page until :func:`~ninfer_kv.resync` repairs the state.  ``fault`` keeps what the
repair needs to know: how far the state got before the slip.  The host compares both with
:meth:`KVStore.require_synced`.

A state whose buffers were donated to a jitted step (or deleted) cannot be used again: flattening
it (any ``jax.jit`` call, ``jax.tree`` function or ``apply_work``) raises
:class:`~ninfer_kv.schema.errors.DonatedStateError`, which names the fix: use the state the step
returned.

A state returned by :func:`~ninfer_kv.take_step_work` carries a static **work-pending mark**
(:attr:`KVDeviceState.work_pending`, part of the pytree's structure, so it costs no device work
and survives the ``jit`` boundary): its planes and block tables do not yet hold the work just
taken.  Reading :attr:`~KVDeviceState.planes` or :attr:`~KVDeviceState.tables` of a marked
state raises :class:`~ninfer_kv.schema.errors.PendingWorkError` naming ``apply_work`` — inside a step
that is at trace time, before anything runs.  :func:`~ninfer_kv.apply_work` clears the mark.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..schema.errors import DonatedStateError, PendingWorkError
from ..schema.geometry import SENTINEL_PAGE
from ..schema.kinds import PoolKind
from ..schema.layout import PagedKVStorageLayout
from ..ops.views import PagedKVBatchLayerView, allocate_planes, ring_table
from ..schema.round_work import BLANK, POISONED, SyncStatus

__all__ = ["KVDeviceState", "check_live", "sync_record"]

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
            "that was lost this way can be replaced with ninfer_kv.allocate_state(store) followed by ninfer_kv.resync(store, "
            "state)"
        )


def sync_record(serial: int, fault=_HEALTHY, owner: int = 0) -> np.ndarray:
    """The ``int32 (5,)`` order record ``(serial, *fault, owner)`` of host values."""
    return np.array([int(serial), *(int(f) for f in np.asarray(fault).reshape(3)), int(owner)], np.int32)


class KVDeviceState:
    """Device planes and block tables of every pool, plus the order record: the applied-work
    serial, the fault record and the owning store in one ``int32 (5,)`` array (:attr:`sync`; read
    it through :attr:`serial`, :attr:`fault` and :attr:`owner`).

    Build it with :func:`~ninfer_kv.device.allocation.allocate_state` (or :meth:`KVDeviceState.zeros`); advance it only
    through :func:`~ninfer_kv.apply_work` and the caller's own steps (which replace ``planes`` via
    :meth:`replace_planes`).  Built by hand it takes ``sync``, or ``serial`` with ``fault``
    (default the healthy ``(-1, -1, -1)``) and ``owner`` (default 0: bound to the store of the
    first work applied in order).

    Immutable: :meth:`replace` and :meth:`replace_planes` return new states.

    Attributes:
      planes: ``{PoolKind: {plane name: stacked plane}}`` (raises :class:`PendingWorkError` while
        :attr:`work_pending`).
      tables: ``{PoolKind: int32 (C, L)}`` block-table matrices (same rule).
      sync: the ``int32 (5,)`` order record.
      layouts: static ``((PoolKind, PagedKVStorageLayout), ...)``: each pool's layout (its page axis,
        and what :meth:`view` builds a layer view with).
      work_pending: static; ``True`` on the state :func:`~ninfer_kv.take_step_work` returns, until
        :func:`~ninfer_kv.apply_work` applies the work taken with it.
      rings: ``{plane name: stacked plane}`` of the window rings (``{}`` when the plan has none);
        works never touch them, so they are readable while work is pending.
      ring: static :class:`~ninfer_kv.planning.rings.RingPlan` of the rings, or ``None``.
    """

    __slots__ = ("_planes", "_tables", "sync", "layouts", "work_pending", "rings", "ring")

    def __init__(self, planes: dict, tables: dict, serial=None, layouts: tuple = (), fault=None, owner=None, *,
                 sync=None, work_pending: bool = False, rings: dict | None = None, ring=None):
        if sync is None:
            if serial is None:
                raise TypeError("KVDeviceState needs sync (the int32 (5,) order record) or serial")
            sync = _record_like(serial, fault, owner)
        elif serial is not None or fault is not None or owner is not None:
            raise TypeError("pass either sync or serial/fault/owner, not both")
        if not isinstance(work_pending, bool):
            raise TypeError(f"work_pending must be a bool, got {work_pending!r}")
        if (ring is None) != (not rings):
            raise ValueError("pass rings (the ring planes) and ring (their RingPlan) together, or neither")
        _build(self, planes, tables, sync, tuple(layouts), work_pending, dict(rings or {}), ring)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: KVDeviceState is immutable "
                                              f"(use state.replace(...))")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}: KVDeviceState is immutable")

    def __repr__(self) -> str:
        pools = ", ".join(k.value for k, _ in self.layouts) or "none"
        mark = ", work pending" if self.work_pending else ""
        rings = f"; rings: {self.ring.spec.num_layers} layers x {self.ring.pages_per_row} pages/row" if self.ring else ""
        return f"KVDeviceState(pools: {pools}{rings}; sync={self.sync!r}{mark})"

    # -- planes and tables: readable once the taken work is applied -------------------------------------
    @property
    def planes(self) -> dict:
        """``{PoolKind: {plane name: stacked plane}}``; :class:`PendingWorkError` while :attr:`work_pending`."""
        if self.work_pending:
            _raise_pending("planes")
        return self._planes

    @property
    def tables(self) -> dict:
        """``{PoolKind: int32 (C, L)}``; :class:`PendingWorkError` while :attr:`work_pending`."""
        if self.work_pending:
            _raise_pending("tables")
        return self._tables

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
    def zeros(cls, pools: Mapping, *, device=None, fill=None, blank: bool = False, owner: int = 0,
              ring=None) -> "KVDeviceState":
        """A fresh state for ``pools = {PoolKind: PoolPlan}`` (a plan's ``pools``): zero (or
        ``fill``) planes, sentinel tables, serial 0, bound to store ``owner`` (0: the store of its
        first work).  ``blank=True`` marks it as holding none of the content of works already
        taken (:func:`~ninfer_kv.device.allocation.allocate_state` after a take): poisoned until a
        :func:`~ninfer_kv.resync`.  ``ring``: a plan's :class:`~ninfer_kv.planning.rings.RingPlan`
        (its ring planes are allocated too), or ``None``."""
        planes, tables, layouts = {}, {}, []
        put = (lambda x: jax.device_put(x, device)) if device is not None else (lambda x: x)
        for kind, pool_plan in pools.items():
            kind = PoolKind.parse(kind)
            planes[kind] = allocate_planes(pool_plan.layout, pool_plan.physical_pages, device=device, fill=fill)
            tables[kind] = put(jnp.full((pool_plan.max_concurrency, pool_plan.logical_pages), SENTINEL_PAGE, jnp.int32))
            layouts.append((kind, pool_plan.layout))
        record = sync_record(POISONED, (0, BLANK, 0), owner) if blank else sync_record(0, _HEALTHY, owner)
        rings = {} if ring is None else allocate_planes(ring.layout, ring.physical_pages, device=device, fill=fill)
        return cls(planes, tables, layouts=tuple(layouts), sync=put(jnp.asarray(record)), rings=rings, ring=ring)

    # -- views ---------------------------------------------------------------------------------------
    def layout(self, pool) -> PagedKVStorageLayout:
        """The :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout` of ``pool`` (a ``PoolKind`` or its name)."""
        kind = PoolKind.parse(pool)
        for k, layout in self.layouts:
            if k is kind:
                return layout
        raise ValueError(f"pool {kind.value} is not in this state; pools: {[k.value for k, _ in self.layouts]}")

    def page_axis(self, pool) -> int:
        """The axis of the physical page ID in ``pool``'s stacked planes (1 page-major, 2 head-major)."""
        return self.layout(pool).order.page_axis

    def view(self, pool, layer) -> PagedKVBatchLayerView:
        """The :class:`~ninfer_kv.ops.views.PagedKVBatchLayerView` of ``pool``'s planes and block tables at
        ``layer`` (a Python int or a traced integer scalar) — what the ops take inside a step.  Put
        the planes a step changed back with :meth:`replace_planes` (``state.replace_planes(pool,
        view.planes)``).  On a mesh, build views inside ``shard_map`` with the store's per-device
        layout instead (``ShardedKVStore.layout``)."""
        kind = PoolKind.parse(pool)
        return PagedKVBatchLayerView(self.pool_planes(kind), self.table(kind), layer, self.layout(kind))

    def ring_view(self, layer) -> PagedKVBatchLayerView:
        """The :class:`~ninfer_kv.ops.views.PagedKVBatchLayerView` of window-ring layer ``layer`` (a
        Python int or a traced integer scalar, in ``[0, ring layers)``): the ring planes with the
        ring table derived from Main's (:func:`~ninfer_kv.ops.views.ring_table`).  Pass the ops a
        ``window=`` no larger than the rings' window; put the changed planes back with
        :meth:`replace_rings`.  ``ValueError`` when the state has no rings."""
        if self.ring is None:
            raise ValueError("this state has no window rings: its plan's ModelKVConfig has rings=None")
        check_live(self)
        table = ring_table(self.tables[PoolKind.MAIN], self.ring.pages_per_row)
        return PagedKVBatchLayerView(self.rings, table, layer, self.ring.layout)

    def replace_rings(self, rings: Mapping) -> "KVDeviceState":
        """A state whose ring planes are ``rings`` (keys, shapes and dtypes as the current ones)."""
        if set(rings) != set(self.rings):
            raise ValueError(f"rings: planes {sorted(rings)} != {sorted(self.rings)}")
        for name, arr in rings.items():
            old = self.rings[name]
            if tuple(arr.shape) != tuple(old.shape) or arr.dtype != old.dtype:
                raise ValueError(f"rings: plane {name!r} is {tuple(arr.shape)} {arr.dtype}, needs "
                                 f"{tuple(old.shape)} {old.dtype}")
        return self.replace(rings=dict(rings))

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
        return self.replace(planes={**self.planes, kind: dict(planes)})

    def replace(self, **changes) -> "KVDeviceState":
        """A copy with the given fields replaced (``planes``, ``tables``, ``sync``, ``layouts``,
        ``work_pending``; ``serial``, ``fault`` and ``owner`` rebuild the order record, the parts not
        named kept).  Replacing ``planes`` or ``tables`` of a state whose work is pending raises
        :class:`PendingWorkError` unless ``work_pending=False`` is passed too (what
        :func:`~ninfer_kv.apply_work` does)."""
        if changes.keys() == {"work_pending"} and isinstance(changes["work_pending"], bool):  # the hot path
            new = object.__new__(KVDeviceState)
            _build(new, self._planes, self._tables, self.sync, self.layouts, changes["work_pending"], self.rings,
                   self.ring)
            return new
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
        unknown = set(changes) - {"planes", "tables", "sync", "layouts", "work_pending", "rings"}
        if unknown:
            raise TypeError(f"KVDeviceState has no field(s) {sorted(unknown)}; fields: planes, tables, sync, "
                            f"layouts, work_pending, rings (and serial, fault, owner)")
        pending = changes.get("work_pending", self.work_pending)
        if not isinstance(pending, bool):
            raise TypeError(f"work_pending must be a bool, got {pending!r}")
        if pending and ("planes" in changes or "tables" in changes):
            _raise_pending("planes" if "planes" in changes else "tables")
        new = object.__new__(KVDeviceState)
        _build(new, changes.get("planes", self._planes), changes.get("tables", self._tables),
               changes.get("sync", self.sync), tuple(changes.get("layouts", self.layouts)), pending,
               changes.get("rings", self.rings), self.ring)
        return new

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


_SET = object.__setattr__


def _build(state: KVDeviceState, planes, tables, sync, layouts: tuple, work_pending: bool, rings, ring) -> None:
    _SET(state, "_planes", planes)
    _SET(state, "_tables", tables)
    _SET(state, "sync", sync)
    _SET(state, "layouts", layouts)
    _SET(state, "work_pending", work_pending)
    _SET(state, "rings", rings)
    _SET(state, "ring", ring)


def _raise_pending(what: str):
    raise PendingWorkError(
        f"this KVDeviceState's {what} were read before the work taken with it was applied: take_step_work "
        f"returned it with a pending RoundWork, and its planes and block tables do not hold that work yet "
        f"(new pages unmapped, COW copies and Host restores missing). Call `state = ninfer_kv.apply_work(state, "
        f"work)` first inside the step (or `apply_work_jit(state, work)` before it)"
    )


def _flatten_with_keys(state: KVDeviceState):
    check_live(state)
    keys = jax.tree_util.GetAttrKey
    children = ((keys("planes"), state._planes), (keys("tables"), state._tables), (keys("sync"), state.sync),
                (keys("rings"), state.rings))
    return children, (state.layouts, state.work_pending, state.ring)


def _flatten(state: KVDeviceState):
    check_live(state)
    return (state._planes, state._tables, state.sync, state.rings), (state.layouts, state.work_pending, state.ring)


def _unflatten(aux, children) -> KVDeviceState:
    # not through __init__: a tree of other leaves (None, specs, layouts) keeps every field as given
    state = object.__new__(KVDeviceState)
    planes, tables, sync, rings = children
    layouts, work_pending, ring = aux
    _build(state, planes, tables, sync, layouts, work_pending, rings, ring)
    return state


jax.tree_util.register_pytree_with_keys(KVDeviceState, _flatten_with_keys, _unflatten, _flatten)
