"""The engine's KV plan: the Main pool sized explicitly or from the memory left after the weights.

``kv_capacity="auto"`` follows the contract's automatic policy: the free bytes ``F`` of the device
after the weights are loaded (``memory_stats()``), minus a headroom, turned into Main pages through
the plan's capacity curve (``M = min(M_max, M_min + floor((F - R - B_min) / B_step))``).  A CPU
reports no memory statistics; there ``F`` is half the memory the host has available, at most
:data:`CPU_KV_BYTES` (the KV cache shares the host with everything else), and a user who wants
more passes ``kv_capacity`` in tokens.

A model with window rings (sliding-window layers, :mod:`ninfer_kv.planning.rings`) pays its rings per
execution row, busy or not.  So ``"auto"`` also sizes the rows: ``max_num_seqs`` rows when every one
of them can hold a ``max_model_len`` sequence in the memory left, else the most rows that can (fewer
rows than asked are said in :attr:`~ninfer_kv.planning.KVPlan.max_concurrency`; a plan needs room for
one full-context sequence in any case, ``M_min >= L``).  An
explicit ``kv_capacity`` keeps ``max_num_seqs`` rows.
"""

from __future__ import annotations

import dataclasses

from ..device.memory import free_device_bytes, host_available_bytes
from ..planning import AutomaticCapacity, ExplicitCapacity, KVPlan, ModelKVConfig, plan_kv_cache
from ..planning.pool_set import full_context_capacity

__all__ = ["CPU_KV_BYTES", "engine_plan", "free_memory_bytes"]

CPU_KV_BYTES = 4 * 2**30
"""The most ``kv_capacity="auto"`` gives the KV cache on a host without device memory statistics."""


def free_memory_bytes(device=None) -> tuple[int, str]:
    """``(bytes, where)``: the device's free memory, or on a CPU half the host's available memory
    capped at :data:`CPU_KV_BYTES`."""
    try:
        return free_device_bytes(device), "free device memory"
    except ValueError:  # a CPU: no memory statistics
        available = host_available_bytes()
        return min(available // 2, CPU_KV_BYTES), f"half the host's available memory, at most {CPU_KV_BYTES >> 30} GiB"


def engine_plan(kv: ModelKVConfig, *, max_model_len: int, max_num_seqs: int, kv_capacity="auto",
                headroom_bytes=0, free_bytes: int | None = None, ring_snapshots: bool = False) -> KVPlan:
    """The KV plan of an engine: ``kv_capacity`` tokens of Main capacity (at most what every row at
    the full context needs, :func:`~ninfer_kv.planning.pool_set.full_context_capacity`), or
    ``"auto"`` (module docstring; ``free_bytes``: the free bytes to plan with, default measured by
    :func:`free_memory_bytes`).  ``ring_snapshots``: a model with window rings gets one snapshot
    slot per row (:mod:`ninfer_kv.device.ring_snapshots`; what prefix caching needs).  Errors name
    the value and what is allowed."""
    if kv_capacity == "auto":
        free = free_memory_bytes()[0] if free_bytes is None else free_bytes
        policy = AutomaticCapacity(free_bytes=free, headroom_bytes=headroom_bytes)
        if kv.rings is not None:
            return _ring_rows_plan(kv, max_model_len, max_num_seqs, policy, ring_snapshots)
    elif isinstance(kv_capacity, bool) or not isinstance(kv_capacity, int):
        raise TypeError(f"kv_capacity={kv_capacity!r} must be 'auto' or an integer number of tokens")
    else:
        if kv_capacity < 1:
            raise ValueError(f"kv_capacity={kv_capacity} must be >= 1 token (or 'auto')")
        # the Main pool never needs more than every row at the full context (M_max pages)
        policy = ExplicitCapacity(min(kv_capacity, full_context_capacity(max_model_len, max_num_seqs)))
    return plan_kv_cache(_with_snapshots(kv, max_num_seqs, ring_snapshots), max_context=max_model_len,
                         max_concurrency=max_num_seqs, policy=policy)


def _with_snapshots(kv: ModelKVConfig, rows: int, ring_snapshots: bool) -> ModelKVConfig:
    """``kv`` with one ring snapshot slot per row when asked (and the model has rings)."""
    if kv.rings is None or not ring_snapshots:
        return kv
    return dataclasses.replace(kv, rings=dataclasses.replace(kv.rings, snapshots=rows))


def _ring_rows_plan(kv: ModelKVConfig, max_model_len: int, max_num_seqs: int, policy: AutomaticCapacity,
                    ring_snapshots: bool) -> KVPlan:
    """The automatic plan of a model with window rings: the most rows up to ``max_num_seqs`` whose
    every row holds a ``max_model_len`` sequence (module docstring); the plan's own error when not
    even one row fits."""

    def plan(rows: int) -> KVPlan:
        return plan_kv_cache(_with_snapshots(kv, rows, ring_snapshots), max_context=max_model_len,
                             max_concurrency=rows, policy=policy)

    def fits(rows: int) -> bool:
        try:
            p = plan(rows)
        except ValueError:
            return False
        return p.m == p.pool_set.m_max

    if fits(max_num_seqs):
        return plan(max_num_seqs)
    lo, hi = 1, max_num_seqs  # one row needs M_min = L pages: plan(1) fits or raises the plan's error
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return plan(lo)
