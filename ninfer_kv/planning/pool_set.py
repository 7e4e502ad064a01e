"""The pool set of a plan: :class:`KVPoolSetLayout`, the one source of every pool's layout and page
count for any ``M``, and the affine :class:`SequenceCapacityCurve` computed from it."""

from __future__ import annotations

import dataclasses

from ..schema.geometry import PAGE_SIZE, ceil_div
from ..schema.kinds import PoolKind, SpeculativeMethod
from ..schema.layout import PagedKVStorageLayout
from ..schema.sizes import INT64_MAX, ByteSize, describe_bytes, format_bytes
from .bounds import (
    INT32_MAX, MAX_CONTEXT, MAX_PAGES, TABLE_ENTRY_BYTES, PlanBoundError, _check_bytes, _int_at_least, _shown_bytes,
    _byte_count,
)
from .config import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, SpeculativeConfig
from .pool_specs import POOL_SPECS
from .rings import RingPlan

__all__ = ["PoolPlan", "SequenceCapacityCurve", "KVPoolSetLayout", "full_context_pages", "full_context_capacity"]


def full_context_pages(max_context: int, max_concurrency: int) -> int:
    """``M_max = C * ceil(S / 64)``: the Main pages that hold every row at the full context,
    the most Main capacity a plan of ``(S, C)`` ever needs."""
    return max_concurrency * ceil_div(max_context, PAGE_SIZE)


def full_context_capacity(max_context: int, max_concurrency: int) -> int:
    """The Main capacity in tokens that holds every row at the full context: ``M_max * 64``
    (:func:`full_context_pages`)."""
    return full_context_pages(max_context, max_concurrency) * PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """One pool of a plan at a concrete ``M``.

    Attributes:
      kind: the :class:`PoolKind`.
      layout: the pool's :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout`.
      physical_pages: pages ``N`` the pool allocates (``M``, or ``M + C * lead`` for MTP).
      logical_pages: ``L = ceil(S / 64)``, the block-table width.
      max_concurrency: ``C``, the block-table height.
    """

    kind: PoolKind
    layout: PagedKVStorageLayout
    physical_pages: int
    logical_pages: int
    max_concurrency: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (64 tokens, every layer, head and plane) of this pool."""
        return self.layout.page_bytes

    @property
    def bytes(self) -> int:
        """Bytes of the pool's planes at ``physical_pages`` (what ``allocate_planes`` creates; no block table)."""
        return self.layout.buffer_bytes(self.physical_pages)

    @property
    def table_shape(self) -> tuple[int, int]:
        """Shape ``(C, L)`` of the pool's ``int32`` block table."""
        return (self.max_concurrency, self.logical_pages)

    @property
    def table_bytes(self) -> int:
        """Bytes of the pool's block table, ``C * L * 4``."""
        return self.max_concurrency * self.logical_pages * TABLE_ENTRY_BYTES

    def to_json(self) -> dict:
        """Profile, order, layers, KV heads, head dim, physical pages and the byte counts, JSON-ready."""
        lay = self.layout
        return {
            "profile": lay.profile.value,
            "order": lay.order.value,
            "layers": lay.num_layers,
            "kv_heads": lay.num_kv_heads,
            "head_dim": lay.head_dim,
            "physical_pages": self.physical_pages,
            "page_bytes": self.page_bytes,
            "bytes": self.bytes,
            "table_bytes": self.table_bytes,
        }


@dataclasses.dataclass(frozen=True)
class SequenceCapacityCurve:
    """Affine ``B(M) = b_min + (M - m_min) * b_step`` on ``[m_min, m_max]``.

    Attributes:
      m_min, m_max: the range of Main pages ``M`` (``max(L, C)`` and ``C * L``).
      b_min: device bytes at ``m_min``: every pool's planes and block table plus the fixed part.
      b_step: device bytes each further Main page adds (over every pool).
    """

    m_min: int
    m_max: int
    b_min: int
    b_step: int

    def bytes_at(self, m: int) -> int:
        """``B(m)`` in bytes.

        Raises:
          ValueError: ``m`` outside ``[m_min, m_max]``.
        """
        if not self.m_min <= m <= self.m_max:
            raise ValueError(f"M={m} is outside the curve's range [{self.m_min}, {self.m_max}]")
        return self.b_min + (m - self.m_min) * self.b_step

    def to_json(self) -> dict:
        """``{"b_min": ..., "b_step": ...}`` (the range is in the plan's JSON)."""
        return {"b_min": self.b_min, "b_step": self.b_step}


class KVPoolSetLayout:
    """The production pool set (every pool's layout) for a model, a speculative method and (S, C).

    It is the single source of every pool's layout and page count as a function of ``M``; the
    capacity curve is computed from it and verified against it, and the device layer's ``allocate_pools`` builds the real
    device buffers from the same layouts.

    Args:
      model: the :class:`ModelKVConfig`.
      max_context: per-sequence ceiling ``S`` in tokens, in ``[1, MAX_CONTEXT]``.
      max_concurrency: execution rows ``C``, at least 1 and small enough that every pool's page
        IDs at ``M_min`` fit int32.
      speculative: the :class:`SpeculativeConfig` (default: method off).
      fixed_bytes: bytes added to every ``B(M)`` (an integer, whole float or byte-size string).

    Attributes:
      model, speculative, max_context, max_concurrency, fixed_bytes: as given (validated; the
        byte count as an exact int).
      page_size: 64.
      logical_pages: ``L = ceil(S / 64)``.
      m_min, m_max: ``max(L, C)`` and ``C * L``.
      layouts: ``{PoolKind: PagedKVStorageLayout}`` of every pool the speculative method needs.
      rings: the :class:`~ninfer_kv.planning.rings.RingPlan` of the model's window rings (a fixed
        part of every ``B(M)``), or ``None``.

    Raises:
      PlanBoundError: a value outside its bounds (also an MTP ``draft_window > max_context``).
      ByteSizeTypeError, ValueError: a ``fixed_bytes`` that is not a byte count.
    """

    def __init__(
        self,
        model: ModelKVConfig,
        max_context: int,
        max_concurrency: int,
        speculative: SpeculativeConfig | None = None,
        fixed_bytes: ByteSize = 0,
    ):
        self.model = model
        self.max_context = _int_at_least(
            "max_context", max_context, 1, MAX_CONTEXT, "token positions and kv_lens are int32"
        )
        self.speculative = speculative or SpeculativeConfig()
        spec = self.speculative
        logical = ceil_div(self.max_context, PAGE_SIZE)
        if spec.method is SpeculativeMethod.MTP and spec.draft_window > self.max_context:
            raise PlanBoundError(
                "draft_window",
                spec.draft_window,
                f"an integer in [1, {self.max_context}]",
                f"the MTP draft window cannot exceed max_context={self.max_context}",
            )
        lead = self._mtp_lead()
        why = f"every pool's page IDs must fit int32: M_min = max(L, C) = max({logical}, C)"
        why += f" plus C * {lead} MTP lead pages" if lead else ""
        self.max_concurrency = _int_at_least(
            "max_concurrency", max_concurrency, 1, _max_concurrency(logical, lead), why + f" <= {MAX_PAGES} pages"
        )
        self.fixed_bytes = _byte_count("fixed_bytes", fixed_bytes)
        self.page_size = PAGE_SIZE
        self.logical_pages = logical
        self.m_min = max(self.logical_pages, self.max_concurrency)
        self.m_max = full_context_pages(self.max_context, self.max_concurrency)
        self.layouts: dict[PoolKind, PagedKVStorageLayout] = {
            kind: POOL_SPECS[kind].layout(model, spec) for kind in spec.pool_kinds()
        }
        self.rings: RingPlan | None = None
        if model.rings is not None:
            if spec.method is not SpeculativeMethod.OFF:
                raise ValueError(f"speculative method {spec.method.value!r} with window rings is not supported: "
                                 "a model with sliding-window layers decodes without speculation")
            self.rings = model.rings.plan(model.profile, model.num_kv_heads, model.head_dim, self.max_concurrency)

    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The pools of this plan, Main first."""
        return tuple(self.layouts)

    def check_m(self, m: int) -> int:
        """``m`` as an int after checking it is a Main page count in ``[M_min, M_max]``."""
        m = _int_at_least("M", m, 1)
        if not self.m_min <= m <= self.m_max:
            raise ValueError(f"M={m} Main pages is outside [{self.m_min}, {self.m_max}]")
        return m

    def _mtp_lead(self) -> int:
        """Most pages per row any pool of the plan may lead Main by (MTP: ``ceil((K - 1) / P)``)."""
        return max(POOL_SPECS[kind].lead_pages(self.speculative) for kind in self.speculative.pool_kinds())

    def physical_pages(self, kind: PoolKind, m: int) -> int:
        """Physical pages of pool ``kind`` at Main capacity ``M`` (its row of ``POOL_SPECS``)."""
        return POOL_SPECS[kind].physical_pages(m, self.max_concurrency, self.speculative)

    def max_m(self) -> int:
        """Largest ``M`` whose every pool's page IDs fit int32 (at most ``M_max``)."""
        return min(self.m_max, MAX_PAGES - self.max_concurrency * self._mtp_lead())

    def clamp_m(self, m: int) -> int:
        """The valid ``M`` nearest to ``m``: ``m`` clamped to ``[M_min, max_m()]``."""
        return min(max(int(m), self.m_min), self.max_m())

    def check_bounds(self, m: int) -> None:
        """Raise :class:`PlanBoundError` unless every pool at ``M`` has int32 page IDs and B(M) fits int64."""
        if m > self.max_m():
            raise PlanBoundError(
                "M",
                m,
                f"an integer in [{self.m_min}, {self.max_m()}]",
                f"every pool's page IDs must fit int32: at most {MAX_PAGES} pages per pool",
            )
        _check_bytes("B(M)", self.device_bytes(m), f"the device bytes at M={m}")

    def pools(self, m: int) -> dict[PoolKind, PoolPlan]:
        """Every pool's :class:`PoolPlan` at ``M = m`` Main pages.

        Raises:
          PlanBoundError: ``m`` is not an integer >= 1.
          ValueError: ``m`` outside ``[m_min, m_max]``.
        """
        m = self.check_m(m)
        return {
            kind: PoolPlan(kind, layout, self.physical_pages(kind, m), self.logical_pages, self.max_concurrency)
            for kind, layout in self.layouts.items()
        }

    @property
    def ring_bytes(self) -> int:
        """Bytes of the window rings (0 without), part of every ``B(M)``."""
        return 0 if self.rings is None else self.rings.bytes

    def device_bytes(self, m: int) -> int:
        """B(M): every pool's buffers + every pool's block table + the window rings + the fixed part."""
        return sum(p.bytes + p.table_bytes for p in self.pools(m).values()) + self.ring_bytes + self.fixed_bytes

    def curve(self) -> SequenceCapacityCurve:
        """The affine curve, computed from two points of the pool set and verified at a third."""
        b_min = self.device_bytes(self.m_min)
        if self.m_max == self.m_min:
            b_step = sum(p.page_bytes for p in self.pools(self.m_min).values())
        else:
            b_step = self.device_bytes(self.m_min + 1) - b_min
        curve = SequenceCapacityCurve(self.m_min, self.m_max, b_min, b_step)
        self.verify_curve(curve, [self.m_max])
        return curve

    def verify_curve(self, curve: SequenceCapacityCurve, ms) -> None:
        """Check ``curve.bytes_at(M) == device_bytes(M)`` at every ``M`` in ``ms``."""
        for m in ms:
            expect = self.device_bytes(m)
            got = curve.bytes_at(m)
            if got != expect:
                raise AssertionError(
                    f"capacity curve mismatch at M={m}: curve {describe_bytes(got)}, "
                    f"pool set {describe_bytes(expect)}"
                )

    # -- capacity policies ----------------------------------------------------------------------
    def resolve(self, policy: "ExplicitCapacity | AutomaticCapacity") -> int:
        """Resolve a capacity policy to ``M`` with the exact formulas of the contract."""
        P = PAGE_SIZE
        if isinstance(policy, ExplicitCapacity):
            k = policy.kv_capacity
            lo_tokens = max(self.max_context, (self.m_min - 1) * P + 1)
            hi_tokens = self.max_m() * P
            m = ceil_div(k, P)
            if k < self.max_context or not self.m_min <= m <= self.max_m():
                cap = "" if self.max_m() == self.m_max else f"; page IDs are int32, so M <= {self.max_m()}"
                raise PlanBoundError(
                    "kv_capacity", k, f"in [{lo_tokens}, {hi_tokens}] tokens",
                    f"max_context={self.max_context}, M_min={self.m_min}, M_max={self.m_max} pages of {P}{cap}",
                )
            return m
        if isinstance(policy, AutomaticCapacity):
            curve = self.curve()
            _check_b_min(self, curve)
            need = policy.headroom_bytes + curve.b_min
            if policy.free_bytes < need:
                raise ValueError(
                    f"free_bytes={policy.free_bytes} is too small: it must be >= headroom_bytes + B_min = "
                    f"{policy.headroom_bytes} + {curve.b_min} = {need} bytes; B_min = {describe_bytes(curve.b_min)} "
                    f"is the device bytes at M_min = {self.m_min}, so {describe_bytes(need)} is needed and "
                    f"{describe_bytes(policy.free_bytes)} is given"
                )
            if self.m_min == self.m_max:
                return self.m_min
            extra = (policy.free_bytes - policy.headroom_bytes - curve.b_min) // curve.b_step
            return min(self.m_max, self.m_min + extra)
        raise TypeError(f"policy must be ExplicitCapacity or AutomaticCapacity, got {type(policy).__name__}")


def _policy_bound_error(pool_set: KVPoolSetLayout, policy, m: int, exc: PlanBoundError) -> PlanBoundError:
    """Re-word a bound ``M`` violates in terms of the policy argument that chose ``M``."""
    curve = pool_set.curve()
    _check_b_min(pool_set, curve)
    limit = min(pool_set.max_m(), pool_set.m_min + (INT64_MAX - curve.b_min) // curve.b_step)
    why = f"it gives M = {m} Main pages, beyond the largest valid M = {limit} ({exc.why})"
    if isinstance(policy, ExplicitCapacity):
        return PlanBoundError("kv_capacity", policy.kv_capacity, f"at most {limit * PAGE_SIZE} tokens", why)
    most = policy.headroom_bytes + curve.bytes_at(limit) + curve.b_step - 1
    return PlanBoundError(
        "free_bytes", policy.free_bytes, f"at most {most} bytes for this plan, {format_bytes(most)}", why,
        shown=_shown_bytes(policy.free_bytes),
    )


def _check_b_min(pool_set: KVPoolSetLayout, curve: SequenceCapacityCurve) -> None:
    if curve.b_min > INT64_MAX:
        raise PlanBoundError(
            "B_min", curve.b_min, f"at most {INT64_MAX} bytes",
            "the device bytes at M_min = max(L, C)"
            + (f", fixed_bytes={pool_set.fixed_bytes} included," if pool_set.fixed_bytes else "")
            + " must fit int64; no device holds this model at this (S, C)",
            shown=_shown_bytes(curve.b_min),
        )


def _max_concurrency(logical_pages: int, lead: int) -> int:
    """Largest C with ``max(L, C) + C * lead <= MAX_PAGES`` (int32 page IDs at M_min), at most int32."""
    if logical_pages + lead > MAX_PAGES:
        return 0
    c = MAX_PAGES // (1 + lead)
    if c < logical_pages:
        c = (MAX_PAGES - logical_pages) // lead
    return min(c, INT32_MAX)
