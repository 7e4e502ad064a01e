"""Repairing a device state that fell out of line with its store.

A state is poisoned by a work applied out of order or from another store, lags when works were
taken but not applied, and is blank when it was allocated after works were taken.  :func:`resync`
brings any of them back in line with the store's own repair plan.  The store is taken by duck
type (``plan_resync``, ``identity``): the device layer imports nothing of :mod:`ninfer_kv.store`.
"""

from __future__ import annotations

import jax

from ..schema.round_work import RoundWork
from .sharded_store import apply_sharded_work_alone
from .state import KVDeviceState, check_live, sync_record
from .work import apply_work_jit

__all__ = ["resync"]


def resync(store, state: KVDeviceState):
    """Bring a poisoned, lagging or blank ``state`` back in line with ``store`` without rebuilding it.

    Reads the state's serial and fault record (one host read), plans the repair on the host
    (:meth:`KVStore.plan_resync`: every block table republished, the page writes the state missed
    replayed from Host replicas still held and live COW sources, the sequences and checkpoints whose
    committed content is gone quarantined) and applies it (the state donated).  Works for a
    :class:`~ninfer_kv.store.KVStore` and a :class:`~ninfer_kv.store.sharded.ShardedKVStore`.

    Returns:
      ``(state, report)``: the repaired state (``store.require_synced`` passes) and a
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
    state = state.replace(sync=jax.device_put(sync_record(work.serial, (-1, -1, -1), store.identity), state.sync.sharding))
    if isinstance(work, RoundWork):
        state = apply_work_jit(state, work)
    else:  # a sharded store's stacked work
        state = apply_sharded_work_alone(store, state, work)
    return state, report
