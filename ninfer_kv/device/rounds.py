"""A round of a jitted step over a store: map -> take the work -> step -> commit.

:func:`run_round` is the whole protocol of one unit for the common case; :func:`take_step_work`
is its middle part, for loops that drive the store's verbs themselves.  :func:`take_step_work` takes a store's next round work padded to a step's fixed shape
(:mod:`ninfer_kv.schema.buckets`), applying an oversized one alone first, so a serving loop compiles
a bounded number of work-applying programs whatever its rounds do; a
:class:`~ninfer_kv.store.sharded.ShardedKVStore`'s work is stacked per shard and placed on its mesh.

The store is taken by duck type (``take_work``; a sharded store also ``kv_mesh`` and ``shards``):
the device layer imports nothing of :mod:`ninfer_kv.store`.
"""

from __future__ import annotations

import dataclasses
import weakref

from ..schema.errors import PendingWorkError
from ..schema.kinds import PoolKind
from ..schema.buckets import StepWorkShapes, step_work_shapes
from .sharded_store import _mesh_of, apply_sharded_work_alone
from .state import KVDeviceState, check_live
from .work import apply_work_jit

__all__ = ["run_round", "take_step_work"]


def take_step_work(store, state: KVDeviceState, shapes: "StepWorkShapes | tuple[int, int, int] | None" = None):
    """Take ``store``'s round work for a step that applies works of one fixed shape.

    ``shapes``: a :class:`~ninfer_kv.schema.buckets.StepWorkShapes` (default
    ``step_work_shapes(store)``), or a bare ``(tables, copies, restores)`` step shape with the default
    alone ladder.  Returns ``(state, work)``: ``work`` padded to the step shape for the step to
    apply; a work that does not fit (COW copies or Host restores after activations, a burst of table
    rows) is padded to the smallest alone shape that holds it and applied first
    (:func:`~ninfer_kv.device.work.apply_work_jit`, the returned ``state``), and the step gets the
    next, empty, take.  So the loop compiles at most ``shapes.programs`` work-applying programs,
    whatever the rounds did.  For a :class:`~ninfer_kv.store.sharded.ShardedKVStore` the work is
    every shard's, stacked, as global arrays on its mesh (``shapes`` are one shard's), and an
    oversized one is applied alone per shard.

    The returned state carries the work-pending mark (:attr:`KVDeviceState.work_pending`): a step
    that reads its planes or tables before ``apply_work(state, work)`` fails when it is traced, with
    :class:`~ninfer_kv.schema.errors.PendingWorkError`.

    Raises (before anything is taken from the store):
      DonatedStateError: ``state`` was donated to a jitted step or deleted (use the state it returned).
      PendingWorkError: ``state`` still carries the mark of an earlier take whose work was never
        applied (apply that work first, or :func:`~ninfer_kv.device.resync.resync`).
    """
    _check_step_state(state)
    if hasattr(store, "kv_mesh"):
        return _take_sharded(store, state, shapes)
    shapes = _shapes(store, shapes)
    work = store.take_work()
    if not work.fits(*shapes.step):
        state = apply_work_jit(state, work.pad_to(*shapes.alone_shape(work.counts().values())))
        work = store.take_work()
    return state.replace(work_pending=True), work.pad_to(*shapes.step)


def _check_step_state(state) -> None:
    """What :func:`take_step_work` checks of the state before taking a work: a live
    :class:`KVDeviceState` whose last taken work was applied (no work-pending mark)."""
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    check_live(state)
    if state.work_pending:
        raise PendingWorkError(
            "this KVDeviceState still carries the work-pending mark of an earlier take_step_work: the work "
            "taken with it was never applied, so taking another would skip it. Apply it (`state = "
            "ninfer_kv.apply_work(state, work)` inside the step, or `ninfer_kv.device.work.apply_work_jit(state, work)`) and "
            "use the state that returns; a work that was lost can be repaired with ninfer_kv.resync(store, state)"
        )


_DEFAULT_SHAPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shapes(store, shapes) -> StepWorkShapes:
    if shapes is None:  # fixed by the store's geometry: computed once per store
        found = _DEFAULT_SHAPES.get(store)
        if found is None:
            found = _DEFAULT_SHAPES[store] = step_work_shapes(store)
        return found
    if isinstance(shapes, StepWorkShapes):
        return shapes
    t, k, r = (int(x) for x in shapes)
    return dataclasses.replace(step_work_shapes(store, tables=t, copies=k, restores=r), step=(t, k, r))


def _take_sharded(store, state: KVDeviceState, shapes):
    """``(state, work)``: the next stacked work padded to the step shape (global arrays on the
    mesh); a work that does not fit is padded to the smallest alone shape holding it and applied
    alone first, and the step gets the next, empty, take.  ``shapes`` as
    :func:`take_step_work`'s (of one shard)."""
    mesh = _mesh_of(store)
    shapes = _shapes(store.shards[0], shapes)
    work = store.take_work()
    if not work.fits(*shapes.step):
        state = apply_sharded_work_alone(store, state, work.pad_to(*shapes.alone_shape(work.counts().values())))
        work = store.take_work()
    return state.replace(work_pending=True), work.pad_to(*shapes.step).device_put(mesh)


def run_round(store, state: KVDeviceState, rows, frontiers, step, *args, pool=PoolKind.MAIN):
    """One unit of a jitted step over ``store``: the store's protocol in one call.

    1. ``store.map(rows, frontiers, pool=pool)`` — pages materialized for every token the unit
       writes (``rows``: execution rows and their frontiers after the unit, or one sequence handle
       and one integer);
    2. :func:`take_step_work` — the round's work, padded to the step's fixed shape;
    3. ``state, out = step(state, work, *args)`` — the caller's jitted step, which runs
       ``apply_work(state, work)`` first (and usually donates ``state``);
    4. ``store.commit(rows, frontiers, pool=pool)`` — only after the step returned.

    Returns ``(state, out)``.  A refused map (bad rows, a target beyond the entitlement) raises
    before anything is taken; an exception in ``step`` propagates with nothing committed (the
    state the step was given may be consumed: repair with :func:`~ninfer_kv.device.resync.resync`,
    after :func:`~ninfer_kv.device.allocation.allocate_state` when it was donated).
    """
    store.map(rows, frontiers, pool=pool)
    state, work = take_step_work(store, state)
    state, out = step(state, work, *args)
    store.commit(rows, frontiers, pool=pool)
    return state, out
