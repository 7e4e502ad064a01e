""":func:`plan_kv_cache`: a resolved :class:`KVPlan` from the model, the speculative method, the per-sequence
ceiling, the concurrency and a capacity policy."""

from __future__ import annotations

import dataclasses

from ..schema.geometry import PAGE_SIZE
from ..schema.kinds import PoolKind
from ..schema.sizes import ByteSize
from .bounds import PlanBoundError
from .config import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, SpeculativeConfig
from .pool_set import KVPoolSetLayout, PoolPlan, SequenceCapacityCurve, _policy_bound_error

__all__ = ["KVPlan", "plan_kv_cache"]

@dataclasses.dataclass(frozen=True)
class KVPlan:
    """A resolved plan: ``M``, every pool at ``M``, and the capacity curve.

    Built by :func:`plan_kv_cache`; :class:`~ninfer_kv.store.KVStore` takes it.

    Attributes:
      pool_set: the :class:`KVPoolSetLayout` the plan was resolved with (``allocate_pools(pool_set, m)``
        builds the planes).
      m: Main pages ``M``.
      pools: ``{PoolKind: PoolPlan}`` at ``M``, Main first.
      curve: the :class:`SequenceCapacityCurve`.
    """

    pool_set: KVPoolSetLayout
    m: int
    pools: dict[PoolKind, PoolPlan]
    curve: SequenceCapacityCurve

    @property
    def rings(self):
        """The :class:`~ninfer_kv.planning.rings.RingPlan` of the window rings, or ``None``."""
        return self.pool_set.rings

    @property
    def capacity_tokens(self) -> int:
        """Published Main capacity ``M * P`` (never raises the per-sequence ceiling S)."""
        return self.m * PAGE_SIZE

    @property
    def device_bytes(self) -> int:
        """``B(M)``: bytes of every pool's planes and block table plus the fixed part."""
        return self.curve.bytes_at(self.m)

    @property
    def max_context(self) -> int:
        """The per-sequence ceiling ``S`` in tokens."""
        return self.pool_set.max_context

    @property
    def max_concurrency(self) -> int:
        """Execution rows ``C`` (block-table rows of every pool)."""
        return self.pool_set.max_concurrency

    @property
    def logical_pages(self) -> int:
        """``L = ceil(S / 64)``, logical pages per sequence (block-table columns)."""
        return self.pool_set.logical_pages

    def to_json(self) -> dict:
        """JSON-ready dict: sizes, ``M``, capacity, every pool, the curve and the device bytes.

        ``ninfer-kv plan --json`` prints this with ``policy``, ``notes`` (and ``draft_window``) added.
        """
        b = self.pool_set
        return {
            "page_size": PAGE_SIZE,
            "max_context": b.max_context,
            "max_concurrency": b.max_concurrency,
            "speculative": b.speculative.method.value,
            "logical_pages": b.logical_pages,
            "m_min": b.m_min,
            "m_max": b.m_max,
            "main_pages": self.m,
            "capacity_tokens": self.capacity_tokens,
            "pools": {k.value: p.to_json() for k, p in self.pools.items()},
            "rings": None if self.rings is None else self.rings.to_json(),
            "curve": self.curve.to_json(),
            "fixed_bytes": b.fixed_bytes,
            "device_bytes": self.device_bytes,
        }


def plan_kv_cache(
    model: ModelKVConfig,
    *,
    max_context: int,
    max_concurrency: int,
    policy: "ExplicitCapacity | AutomaticCapacity",
    speculative: SpeculativeConfig | None = None,
    fixed_bytes: ByteSize = 0,
) -> KVPlan:
    """Resolve ``policy`` to a :class:`KVPlan` for ``model`` under (S, C) and the speculative method.

    Args:
      model: the :class:`ModelKVConfig`.
      max_context: per-sequence ceiling ``S`` in tokens.
      max_concurrency: execution rows ``C`` (sequences resident at once).
      policy: :class:`ExplicitCapacity` (tokens) or :class:`AutomaticCapacity` (free bytes).
      speculative: the :class:`SpeculativeConfig` (default: method off, Main pool only).
      fixed_bytes: bytes added to every ``B(M)`` (an integer, whole float or byte-size string).

    Planning allocates nothing (:func:`~ninfer_kv.device.allocation.allocate_pools` does).

    Raises:
      PlanBoundError: a value outside its bounds, worded in terms of the argument that caused it
        (``kv_capacity`` or ``free_bytes`` when the chosen ``M`` is too large).
      ValueError: ``AutomaticCapacity`` with ``free_bytes < headroom_bytes + B_min``.
      TypeError: a policy of another type.
    """
    pool_set = KVPoolSetLayout(model, max_context, max_concurrency, speculative, fixed_bytes)
    m = pool_set.resolve(policy)
    try:
        pool_set.check_bounds(m)
    except PlanBoundError as exc:
        raise _policy_bound_error(pool_set, policy, m, exc) from None
    return KVPlan(pool_set=pool_set, m=m, pools=pool_set.pools(m), curve=pool_set.curve())
