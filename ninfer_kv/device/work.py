"""Applying round works to a device state: the pure function the caller's step runs, and the
device side of offloads and repairs.

* :func:`apply_work` (pure; inside the caller's jitted step, the state donated) applies one
  :class:`~ninfer_kv.work.RoundWork`: table updates scattered into each pool's ``(C, L)`` matrix,
  page writes into the planes, the serial advanced — or, for a work out of order or of another
  store, the state poisoned (nothing applied, every table entry the sentinel page).
* :func:`apply_work_jit` runs it alone; :func:`take_step_work` takes a store's work padded to a
  step's fixed shape (:mod:`ninfer_kv.step_shapes`), applying an oversized one alone first.
* :func:`gather_pages` gathers an offload plan's pages (an :class:`~ninfer_kv.work.OffloadPayload`).
* :func:`resync` repairs a poisoned, lagging or blank state with the store's plan.

The functions take a store by duck type (``take_work``, ``plan_resync``, ``identity``): the device
layer imports nothing of :mod:`ninfer_kv.store`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..geometry import SENTINEL_PAGE
from ..step_shapes import StepWorkShapes, step_work_shapes
from ..work import POISONED, GatherRequest, OffloadPayload, RoundWork
from . import pytrees  # noqa: F401  (the work dataclasses as pytrees)
from .page_copy import _words, cpu_float, write_pages, write_pages_donated
from .state import KVDeviceState, check_live

__all__ = ["apply_work", "apply_work_jit", "resync", "gather_pages", "gather_pages_jit", "take_step_work"]


def _check_pair(state, work) -> None:
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    if not isinstance(work, RoundWork):
        raise TypeError(f"work must be a RoundWork, got {type(work).__name__}")
    check_live(state)
    if set(work.pools) != set(state.planes):
        raise ValueError(
            f"the work names pools {sorted(k.value for k in work.pools)}, the state holds "
            f"{sorted(k.value for k in state.planes)}"
        )


def _in_order(serial, owner, work_serial, work_store) -> jax.Array:
    """Whether the work numbered ``work_serial`` of store ``work_store`` is the next work of a healthy
    state at ``serial`` bound to store ``owner`` (0 on either side: unbound)."""
    serial, owner = jnp.asarray(serial, jnp.int32), jnp.asarray(owner, jnp.int32)
    work_store = jnp.asarray(work_store, jnp.int32)
    same_store = (owner == work_store) | (owner == 0) | (work_store == 0)
    return (serial == jnp.asarray(work_serial, jnp.int32)) & (serial >= 0) & same_store


def _gate(entries: jax.Array, row: int, ok: jax.Array) -> jax.Array:
    """``entries`` with row ``row`` (the columns of page writes) zeroed unless ``ok``: padding."""
    return entries.at[row].set(jnp.where(ok, entries[row], 0))


def apply_work(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """Apply one :class:`RoundWork` to the state (pure; call it inside a jitted step, donated).

    Table updates are scattered into each pool's ``(C, L)`` matrix; page writes land in the
    planes; ``serial`` advances when ``work.serial`` equals it and the work comes from the state's
    store (an unbound state binds to it).  Otherwise the state is poisoned:
    nothing of the work is applied, every table entry becomes the sentinel page (so the ops of
    this and later steps drop their tokens instead of touching pages), and ``fault`` records the
    first mismatch until :func:`resync` repairs the state.
    """
    _check_pair(state, work)
    ok = _in_order(state.serial, state.owner, work.serial, work.store)
    serial, owner = jnp.asarray(state.serial, jnp.int32), jnp.asarray(state.owner, jnp.int32)
    work_serial, work_store = jnp.asarray(work.serial, jnp.int32), jnp.asarray(work.store, jnp.int32)
    new_serial = jnp.where(ok, serial + 1, jnp.int32(POISONED))
    new_owner = jnp.where(ok & (owner == 0), work_store, owner)
    first = (serial >= 0) & ~ok
    fault = jnp.asarray(state.fault, jnp.int32)
    new_fault = jnp.where(first, jnp.stack([serial, work_serial, work_store]), fault)
    tables, planes = {}, {}
    for kind, pw in work.pools.items():
        table = state.tables[kind]
        if pw.tables.shape[1]:
            upd = jnp.asarray(pw.tables, jnp.int32)
            update = lambda t, upd=upd: t.at[upd[0], upd[1]].set(upd[2], mode="drop")  # noqa: E731
        else:
            update = lambda t: t  # noqa: E731
        # a cond, not a select: the healthy branch updates the donated table in place
        tables[kind] = jax.lax.cond(ok, update, lambda t: jnp.full_like(t, SENTINEL_PAGE), table)
        copies, restores = jnp.asarray(pw.copies, jnp.int32), jnp.asarray(pw.restores, jnp.int32)
        if copies.shape[1]:
            copies = _gate(copies, 2, ok)
        if restores.shape[1]:
            restores = _gate(restores, 1, ok)
        planes[kind] = write_pages(state.planes[kind], copies, restores, pw.payload, state.page_axis(kind))
    return dataclasses.replace(state, planes=planes, tables=tables, serial=new_serial, fault=new_fault, owner=new_owner)


_apply_work_jit = jax.jit(apply_work, donate_argnums=(0,))
_in_order_jit = jax.jit(_in_order)


def apply_work_jit(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """:func:`apply_work` run alone, the state donated (when no step applies this work).

    One jitted program; except on the CPU backend with page writes into float planes, where a
    scatter is not kept in place by XLA (the whole plane would be copied): there the page writes run
    as in-place per-page programs (:func:`~ninfer_kv.page_copy.write_pages_donated`, which write
    nothing when the work is out of order), then the table updates and the serial as one program.
    Same result either way.
    """
    _check_pair(state, work)
    writes = [k for k, p in work.pools.items() if p.copies.shape[1] or p.restores.shape[1]]
    if not writes or not any(cpu_float(state.planes[k]) for k in writes):
        return _apply_work_jit(state, work)
    ok = _in_order_jit(state.serial, state.owner, work.serial, work.store)
    planes = dict(state.planes)
    for kind in writes:
        pw = work.pools[kind]
        planes[kind] = write_pages_donated(
            planes[kind], pw.copies, pw.restores, pw.payload, state.page_axis(kind), enabled=ok
        )
    state = dataclasses.replace(state, planes=planes)
    return _apply_work_jit(state, work.without_page_writes())


def _like(x: jax.Array, value) -> jax.Array:
    """``value`` as an int32 array placed like ``x``."""
    return jax.device_put(np.asarray(value, np.int32), x.sharding)


def resync(store, state: KVDeviceState):
    """Bring a poisoned, lagging or blank ``state`` back in line with ``store`` without rebuilding it.

    Reads the state's serial and fault record (one host read), plans the repair on the host
    (:meth:`KVStore.plan_resync`: every block table republished, the page writes the state missed
    replayed from Host replicas still held and live COW sources, the sequences and checkpoints whose
    committed content is gone quarantined) and applies it (the state donated).  Works for a
    :class:`~ninfer_kv.store.KVStore` and a :class:`~ninfer_kv.store.sharded.ShardedKVStore`.

    Returns:
      ``(state, report)``: the repaired state (``store.check_state`` passes) and a
      :class:`~ninfer_kv.store.repair.ResyncReport` naming every quarantined handle with the tokens
      the device still holds of it.  A state already in line is returned as it is.

    Raises:
      WorkOrderError: the state applied more works than the store handed out (another store's).
      DonatedStateError: the state was donated; repair the state the step returned.
    """
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    check_live(state)
    work, report = store.plan_resync(state.sync_status())
    if work is None:
        return state, report
    state = state.replace(
        serial=_like(state.serial, work.serial),
        fault=_like(state.fault, (-1, -1, -1)),
        owner=_like(state.owner, store.identity),
    )
    if isinstance(work, RoundWork):
        state = apply_work_jit(state, work)
    else:  # a sharded store's stacked work
        state = store.apply_work_alone(state, work)
    return state, report


def _gather(state: KVDeviceState, pages: Mapping) -> dict:
    out = {}
    for kind, ids in pages.items():
        axis = state.page_axis(kind)
        ids = jnp.asarray(ids, jnp.int32)
        out[kind] = {
            name: jnp.moveaxis(jnp.take(_words(x), ids, axis=axis), axis, 0) for name, x in state.planes[kind].items()
        }
    return out


def gather_pages(state: KVDeviceState, request: "GatherRequest | Mapping"):
    """Pure, jittable gather of whole pages for an offload.

    With an offload plan's ``request`` (:attr:`OffloadPlan.request`) returns an
    :class:`OffloadPayload` — the pages' words, the state's applied-work serial (the offload checks
    that the state saw every work it needs) and the plan's identity, which
    :meth:`KVStore.complete_offload` checks.  With a bare ``{PoolKind: int32 (B,)}`` returns
    ``(serial, {PoolKind: {plane: words (B, layers, H, P, X)}})`` (no identity: not a payload an
    offload accepts).
    """
    if isinstance(request, GatherRequest):
        pages = {k: jnp.asarray(v, jnp.int32) for k, v in request.pages.items()}
        return OffloadPayload(
            jnp.asarray(request.store, jnp.int32),
            jnp.asarray(request.token, jnp.int32),
            state.serial,
            pages,
            _gather(state, pages),
        )
    return state.serial, _gather(state, request)


gather_pages_jit = jax.jit(gather_pages)


def take_step_work(store, state: KVDeviceState, shapes: "StepWorkShapes | tuple[int, int, int] | None" = None):
    """Take ``store``'s round work for a step that applies works of one fixed shape.

    ``shapes``: a :class:`~ninfer_kv.store.step_shapes.StepWorkShapes` (default
    ``step_work_shapes(store)``), or a bare ``(tables, copies, restores)`` step shape with the default
    alone ladder.  Returns ``(state, work)``: ``work`` padded to the step shape for the step to
    apply; a work that does not fit (COW copies or Host restores after activations, a burst of table
    rows) is padded to the smallest alone shape that holds it and applied first
    (:func:`apply_work_jit`, the returned ``state``), and the step gets the next, empty, take.  So
    the loop compiles at most ``shapes.programs`` work-applying programs, whatever the rounds did.
    """
    shapes = _shapes(store, shapes)
    work = store.take_work()
    if not work.fits(*shapes.step):
        state = apply_work_jit(state, work.pad_to(*shapes.alone_shape(work.counts().values())))
        work = store.take_work()
    return state, work.pad_to(*shapes.step)


def _shapes(store, shapes) -> StepWorkShapes:
    if shapes is None:
        return step_work_shapes(store)
    if isinstance(shapes, StepWorkShapes):
        return shapes
    t, k, r = (int(x) for x in shapes)
    return dataclasses.replace(step_work_shapes(store, tables=t, copies=k, restores=r), step=(t, k, r))
