"""The engine's KV plan: the Main pool sized explicitly or from the memory left after the weights.

``kv_capacity="auto"`` follows the contract's automatic policy: the free bytes ``F`` of the device
after the weights are loaded (``memory_stats()``), minus a headroom, turned into Main pages through
the plan's capacity curve (``M = min(M_max, M_min + floor((F - R - B_min) / B_step))``).  A CPU
reports no memory statistics; there ``F`` is half the memory the host has available, at most
:data:`CPU_KV_BYTES` (the KV cache shares the host with everything else), and a user who wants
more passes ``kv_capacity`` in tokens.
"""

from __future__ import annotations

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
                headroom_bytes=0) -> KVPlan:
    """The KV plan of an engine: ``kv_capacity`` tokens of Main capacity (at most what every row at
    the full context needs, :func:`~ninfer_kv.planning.pool_set.full_context_capacity`), or
    ``"auto"`` (module docstring).  Errors name the value and what is allowed."""
    if kv_capacity == "auto":
        free, _ = free_memory_bytes()
        policy = AutomaticCapacity(free_bytes=free, headroom_bytes=headroom_bytes)
    elif isinstance(kv_capacity, bool) or not isinstance(kv_capacity, int):
        raise TypeError(f"kv_capacity={kv_capacity!r} must be 'auto' or an integer number of tokens")
    else:
        if kv_capacity < 1:
            raise ValueError(f"kv_capacity={kv_capacity} must be >= 1 token (or 'auto')")
        # the Main pool never needs more than every row at the full context (M_max pages)
        policy = ExplicitCapacity(min(kv_capacity, full_context_capacity(max_model_len, max_num_seqs)))
    return plan_kv_cache(kv, max_context=max_model_len, max_concurrency=max_num_seqs, policy=policy)
