"""Applying round works to a device state: the pure function the caller's step runs, and the
gather of an offload's pages.

* :func:`apply_work` (pure; inside the caller's jitted step, the state donated) applies one
  :class:`~ninfer_kv.schema.round_work.RoundWork`: table updates scattered into each pool's ``(C, L)`` matrix,
  page writes into the planes, the serial advanced — or, for a work out of order or of another
  store, the state poisoned (nothing applied, every table entry the sentinel page).
* :func:`apply_work_jit` runs it alone (:func:`~ninfer_kv.device.rounds.take_step_work` pads a
  store's work to a step's fixed shape, applying an oversized one alone first with it).
* :func:`gather_pages` gathers an offload plan's pages (an :class:`~ninfer_kv.schema.round_work.OffloadPayload`).
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp

from ..schema.geometry import SENTINEL_PAGE
from ..schema.round_work import POISONED, GatherRequest, OffloadPayload, RoundWork
from ..ops.page_copy import _words, cpu_float, write_pages, write_pages_donated
from . import pytrees  # noqa: F401  (the work dataclasses as pytrees)
from .state import KVDeviceState, check_live

__all__ = [
    "apply_work",
    "apply_work_reference",
    "apply_work_jit",
    "gather_pages",
    "gather_pages_jit",
]


def _check_pair(state, work) -> KVDeviceState:
    """Check a ``(state, work)`` pair; return the state with its work-pending mark cleared (the work is
    about to be applied)."""
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    if not isinstance(work, RoundWork):
        raise TypeError(f"work must be a RoundWork, got {type(work).__name__}")
    check_live(state)
    if state.work_pending:
        state = state.replace(work_pending=False)
    if set(work.pools) != set(state.planes):
        raise ValueError(
            f"the work names pools {sorted(k.value for k in work.pools)}, the state holds "
            f"{sorted(k.value for k in state.planes)}"
        )
    return state


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


def _poisoned_unless(ok: jax.Array, table: jax.Array) -> jax.Array:
    """``table`` when ``ok``, else every entry the sentinel page.

    A loop that runs once when the work is out of order and not at all otherwise: a loop's carry
    stays in the donated table's buffer, where a ``cond`` makes XLA's CPU compiler copy the table
    into the conditional's result (about a third of a decode step at C = 256, L = 512) and a
    select reads and writes the whole table every step.
    """

    def fill(carry):
        return jnp.full_like(carry[0], SENTINEL_PAGE), jnp.asarray(False)

    return jax.lax.while_loop(lambda carry: carry[1], fill, (table, ~ok))[0]


def apply_work(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """Apply one :class:`RoundWork` to the state (pure; call it inside a jitted step, donated).

    Table updates are scattered into each pool's ``(C, L)`` matrix; page writes land in the
    planes; ``serial`` advances when ``work.serial`` equals it and the work comes from the state's
    store (an unbound state binds to it).  Otherwise the state is poisoned:
    nothing of the work is applied, every table entry becomes the sentinel page (so the ops of
    this and later steps drop their tokens instead of touching pages), and ``fault`` records the
    first mismatch until :func:`resync` repairs the state.

    Lowered per platform: on the CPU, when the FFI library is loaded, by two in-place custom calls
    (:func:`~ninfer_kv.ops.ffi.work_ops.apply_tables`, and :func:`~ninfer_kv.ops.ffi.work_ops.write_pages` for a
    pool with page writes), which touch only the entries and pages the work names; elsewhere by
    :func:`apply_work_reference`.  Both give the same bits.

    Clears the state's work-pending mark (:attr:`KVDeviceState.work_pending`), so the planes and
    tables of the state it returns can be read.
    """
    state = _check_pair(state, work)
    if not _ffi_lowering():
        return apply_work_reference(state, work)
    return jax.lax.platform_dependent(state, work, cpu=_apply_work_ffi, default=apply_work_reference)


def apply_work_reference(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """:func:`apply_work` in ``jax.numpy`` (the lowering on accelerators, and the reference of the
    CPU custom calls): one scatter per table, a loop that fills the tables with the sentinel when
    the work is out of order, and one batched page write per pool (:func:`write_pages`)."""
    _check_pair(state, work)
    sync = jnp.asarray(state.sync, jnp.int32)
    serial, owner = sync[0], sync[4]
    work_serial, work_store = jnp.asarray(work.serial, jnp.int32), jnp.asarray(work.store, jnp.int32)
    ok = _in_order(serial, owner, work_serial, work_store)
    first = (serial >= 0) & ~ok  # the first slip: the fault record keeps it
    new_sync = jnp.stack([
        jnp.where(ok, serial + 1, jnp.int32(POISONED)),
        jnp.where(first, serial, sync[1]),
        jnp.where(first, work_serial, sync[2]),
        jnp.where(first, work_store, sync[3]),
        jnp.where(ok & (owner == 0), work_store, owner),
    ])
    tables, planes = {}, {}
    for kind, pw in work.pools.items():
        table = state.tables[kind]
        if pw.tables.shape[1]:
            upd = jnp.asarray(pw.tables, jnp.int32)
            rows = jnp.where(ok, upd[0], table.shape[0])  # out of order: every entry out of range, dropped
            table = table.at[rows, upd[1]].set(upd[2], mode="drop")
        tables[kind] = _poisoned_unless(ok, table)
        copies, restores = jnp.asarray(pw.copies, jnp.int32), jnp.asarray(pw.restores, jnp.int32)
        if copies.shape[1]:
            copies = _gate(copies, 2, ok)
        if restores.shape[1]:
            restores = _gate(restores, 1, ok)
        planes[kind] = write_pages(state.planes[kind], copies, restores, pw.payload, state.page_axis(kind))
    return state.replace(planes=planes, tables=tables, sync=new_sync)


def _apply_work_ffi(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """The CPU lowering: the order check and every table's updates in one in-place custom call,
    then each pool's page writes in one in-place custom call (gated by the same check, on the
    record as it was before the work)."""
    from ninfer_kv.ops.ffi import work_ops as ffi_work_ops

    kinds = list(work.pools)
    updates = [jnp.asarray(work.pools[k].tables, jnp.int32).reshape(3, -1) for k in kinds]
    sync, tables = ffi_work_ops.apply_tables(state.sync, work.stamp, [state.tables[k] for k in kinds], updates)
    planes = dict(state.planes)
    for kind in kinds:
        pw = work.pools[kind]
        if pw.copies.shape[1] or pw.restores.shape[1]:
            planes[kind] = ffi_work_ops.write_pages(
                state.sync, work.stamp, state.planes[kind], pw.copies, pw.restores, pw.payload,
                page_axis=state.page_axis(kind),
            )
    return state.replace(planes=planes, tables=dict(zip(kinds, tables)), sync=sync)


@functools.cache
def _ffi_lowering() -> bool:
    """Whether the CPU lowering's custom calls are registered (the FFI library loaded); checked once."""
    from ninfer_kv.host import ffi_library
    from ninfer_kv.ops.ffi import handlers as ffi_handlers

    try:
        return ffi_handlers.is_available()
    except ffi_library.FFIUnavailableError:  # a bad $NINFER_KV_FFI_LIBRARY: the ops say so; here, jnp
        return False


_apply_work_jit = jax.jit(apply_work, donate_argnums=(0,))
_in_order_jit = jax.jit(_in_order)


def apply_work_jit(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """:func:`apply_work` run alone, the state donated (when no step applies this work).

    One jitted program; except on a CPU without the FFI library, with page writes into
    float planes, where XLA does not keep a scatter in place (the whole plane would be copied):
    there the page writes run as in-place per-page programs
    (:func:`~ninfer_kv.ops.page_copy.write_pages_donated`, which write nothing when the work is out of
    order), then the table updates and the serial as one program.  Same result either way.
    """
    state = _check_pair(state, work)  # the mark cleared on the host: one program with or without it
    writes = [k for k, p in work.pools.items() if p.copies.shape[1] or p.restores.shape[1]]
    if not writes or not any(cpu_float(state.planes[k]) for k in writes) or _ffi_lowering():
        return _apply_work_jit(state, work)
    ok = _in_order_jit(state.sync[0], state.sync[4], work.serial, work.store)
    planes = dict(state.planes)
    for kind in writes:
        pw = work.pools[kind]
        planes[kind] = write_pages_donated(
            planes[kind], pw.copies, pw.restores, pw.payload, state.page_axis(kind), enabled=ok
        )
    state = state.replace(planes=planes)
    return _apply_work_jit(state, work.without_page_writes())


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


