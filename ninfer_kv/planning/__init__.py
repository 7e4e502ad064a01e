"""Startup planning: pool set, capacity policies and the affine SequenceCapacityCurve.

Notation: ``S`` = max_context, ``C`` = max_concurrency, ``P = 64``,
``L = ceil(S / P)``, ``M`` = Main pages.

* ``M_min = max(L, C)``, ``M_max = C * L``.
* Explicit policy (``kv_capacity`` tokens ``K``): ``M = ceil(K / P)``, with ``K >= S`` and
  ``M_min <= M <= M_max``.
* Automatic policy (free bytes ``F``, headroom ``R``):
  ``M = min(M_max, M_min + floor((F - R - B_min) / B_step))``, requiring ``F >= R + B_min``.
* ``B(M) = B_min + (M - M_min) * B_step``: every pool's page bytes + every pool's block table
  (``C * L * 4`` bytes) + the window rings of sliding-window layers (``C * k`` pages, :mod:`.rings`)
  + a caller-supplied fixed part.
* Backend pages: MTP ``M + C * ceil((K_draft - 1) / P)``; Draft Full ``M``.

:class:`KVPoolSetLayout` is the one pool set: it gives each pool's :class:`PagedKVStorageLayout`
and page count for any ``M``, allocates the real buffers, and is what the curve is computed from
and verified against.

Bounds.  Every byte count is an exact Python int and must fit int64; every physical page ID of
every pool (``0 .. pages - 1``) and every token position of a sequence (``0 .. L * P - 1``, and
``kv_lens`` up to ``L * P``) must fit the int32 block tables and position arrays; layers,
KV heads and head dim are bounded far above any real model (:data:`MAX_LAYERS`,
:data:`MAX_KV_HEADS`, :data:`MAX_HEAD_DIM`).  A value outside these bounds raises
:class:`PlanBoundError` (a ``ValueError``) naming the parameter, its value and the allowed range.

Byte counts.  ``AutomaticCapacity(free_bytes=, headroom_bytes=)`` and ``fixed_bytes`` take an
integer, a whole-number float or a byte-size string such as ``"40GiB"`` (the syntax of the command
line, :mod:`ninfer_kv.schema.sizes`); the exact ``int`` is what gets stored.  A wrong type raises
:class:`~ninfer_kv.schema.sizes.ByteSizeTypeError` (a ``TypeError``, also a ``ValueError``).  Errors print
byte counts exactly with the binary-unit form beside them (``34,361,835,520 B (32.00 GiB)``).

Modules: :mod:`.config` (what a deployment states: model, speculative method, capacity policy),
:mod:`.bounds` (the limits and :class:`PlanBoundError`), :mod:`.pool_set` (the pool set and
the capacity curve), :mod:`.rings` (the per-row rings of sliding-window layers), :mod:`.plan` (:func:`plan_kv_cache`), :mod:`.mesh_plan` (planning over a
device mesh).  All of it is arithmetic: reading free device memory lives in
:mod:`ninfer_kv.device.memory`, allocating a plan's planes in :mod:`ninfer_kv.device.allocation`.
"""

from __future__ import annotations

from .bounds import (
    INT32_MAX,
    MAX_CONTEXT,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_PAGES,
    TABLE_ENTRY_BYTES,
    PlanBoundError,
    check_pool_bytes,
)
from .config import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, SpeculativeConfig
from .mesh_plan import MeshKVPlan, plan_kv_cache_mesh
from .plan import KVPlan, plan_kv_cache
from .pool_set import KVPoolSetLayout, PoolPlan, SequenceCapacityCurve
from .rings import DEFAULT_RING_STEP_TOKENS, RingPlan, WindowRings

__all__ = [
    "SpeculativeConfig",
    "ModelKVConfig",
    "PoolPlan",
    "ExplicitCapacity",
    "AutomaticCapacity",
    "SequenceCapacityCurve",
    "KVPoolSetLayout",
    "KVPlan",
    "plan_kv_cache",
    "TABLE_ENTRY_BYTES",
    "PlanBoundError",
    "INT32_MAX",
    "MAX_PAGES",
    "MAX_CONTEXT",
    "MAX_LAYERS",
    "MAX_KV_HEADS",
    "MAX_HEAD_DIM",
    "check_pool_bytes",
    "MeshKVPlan",
    "plan_kv_cache_mesh",
    "WindowRings",
    "RingPlan",
    "DEFAULT_RING_STEP_TOKENS",
]
