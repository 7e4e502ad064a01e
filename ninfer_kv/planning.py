"""Startup planning: pool set, capacity policies and the affine SequenceCapacityCurve.

Notation: ``S`` = max_context, ``C`` = max_concurrency, ``P = 64``,
``L = ceil(S / P)``, ``M`` = Main page groups.

* ``M_min = max(L, C)``, ``M_max = C * L``.
* Explicit policy (``kv_capacity`` tokens ``K``): ``M = ceil(K / P)``, with ``K >= S`` and
  ``M_min <= M <= M_max``.
* Automatic policy (free bytes ``F``, headroom ``R``):
  ``M = min(M_max, M_min + floor((F - R - B_min) / B_step))``, requiring ``F >= R + B_min``.
* ``B(M) = B_min + (M - M_min) * B_step``: every pool's page bytes + every pool's block table
  (``C * L * 4`` bytes) + a caller-supplied fixed part.
* Backend pages: MTP ``M + C * ceil((K_draft - 1) / P)``; Draft Full ``M``.

:class:`KVPoolSetLayout` is the one builder: it gives each pool's :class:`PagedKVStorageLayout`
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
line, :mod:`ninfer_kv.units`); the exact ``int`` is what gets stored.  A wrong type raises
:class:`~ninfer_kv.units.ByteSizeTypeError` (a ``TypeError``, also a ``ValueError``).  Errors print
byte counts exactly with the binary-unit form beside them (``34,361,835,520 B (32.00 GiB)``).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np

from .geometry import PAGE_SIZE, PlaneOrder, ceil_div
from .layout import PagedKVStorageLayout
from .profiles import KVProfile
from .units import INT64_MAX, ByteSize, byte_range, describe_bytes, format_bytes, to_byte_count

__all__ = [
    "SpeculativeBackend",
    "SpeculativeConfig",
    "PoolKind",
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
    "INT64_MAX",
    "MAX_PAGES",
    "MAX_CONTEXT",
    "MAX_LAYERS",
    "MAX_KV_HEADS",
    "MAX_HEAD_DIM",
    "check_pool_bytes",
    "MeshKVPlan",
    "plan_kv_cache_mesh",
]

TABLE_ENTRY_BYTES = 4  # int32 block-table entries
INT32_MAX = 2**31 - 1
MAX_PAGES = INT32_MAX + 1
"""Most physical page groups one pool may hold: page IDs ``0 .. MAX_PAGES - 1`` fit int32."""
MAX_CONTEXT = (INT32_MAX // PAGE_SIZE) * PAGE_SIZE
"""Largest ``S``: the positions ``0 .. L * P - 1`` and ``kv_lens <= L * P`` fit int32."""
MAX_LAYERS = 4096
"""Most layers one pool stacks (its plane inventory has one entry per layer and plane)."""
MAX_KV_HEADS = 65536
"""Most KV heads."""
MAX_HEAD_DIM = 65536
"""Largest head dim."""


class PlanBoundError(ValueError):
    """A planning value outside its allowed range.

    Attributes:
      name: the parameter (``max_context``, ``draft_window``, ...).
      value: the value given.
      allowed: the allowed range in words (``"an integer in [1, 8192]"``).
      why: the reason for the bound, or ``""``.
      shown: the value as printed after ``name=`` (default ``repr(value)``; byte counts add the
        binary-unit form).
    """

    def __init__(self, name: str, value: object, allowed: str, why: str = "", *, shown: str | None = None):
        self.name, self.value, self.allowed, self.why = name, value, allowed, why
        shown = repr(value) if shown is None else shown
        super().__init__(f"{name}={shown} is out of range; it must be {allowed}" + (f" ({why})" if why else ""))


def _int_at_least(name: str, value: object, minimum: int, maximum: int | None = None, why: str = "") -> int:
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise PlanBoundError(name, value, allowed, why)
    if value < minimum or (maximum is not None and value > maximum):
        raise PlanBoundError(name, int(value), allowed, why)
    return int(value)


def _shown_bytes(value: object) -> str:
    """``repr(value)``, with the binary-unit form beside an integer byte count of 1 KiB or more."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        return f"{value!r} ({format_bytes(value)})"
    return repr(value)


def _byte_count(name: str, value: object) -> int:
    """A byte-count argument (integer, whole float or byte-size string) as an int in ``[0, INT64_MAX]``."""
    count = to_byte_count(value, name)
    if not 0 <= count <= INT64_MAX:
        shown = repr(value) + (f" ({format_bytes(count)})" if count >= 1024 else "")
        raise PlanBoundError(name, value, byte_range(0, INT64_MAX), "byte counts are int64", shown=shown)
    return count


def _check_bytes(name: str, value: int, what: str) -> int:
    if value > INT64_MAX:
        raise PlanBoundError(
            name, value, f"at most {INT64_MAX} bytes", f"{what} must fit int64", shown=_shown_bytes(value)
        )
    return value


class SpeculativeBackend(enum.Enum):
    """Speculative backends; mutually exclusive within one engine.

    ``OFF``: Main pool only.  ``MTP``: a multi-token-prediction head with its own MTP pool.
    ``DFLASH`` / ``DFLASH2``: a draft model whose full-attention layers get a Draft Full pool
    (when :attr:`SpeculativeConfig.draft_full_layers` > 0).
    """

    OFF = "off"
    MTP = "mtp"
    DFLASH = "dflash"
    DFLASH2 = "dflash2"

    @classmethod
    def parse(cls, name: "str | SpeculativeBackend") -> "SpeculativeBackend":
        """Resolve ``"off"``, ``"mtp"``, ``"dflash"`` or ``"dflash2"`` (case and spaces ignored) or a member.

        Raises:
          ValueError: any other value, naming it and the allowed names.
        """
        if isinstance(name, SpeculativeBackend):
            return name
        if isinstance(name, str):
            for member in cls:
                if name.strip().lower() == member.value:
                    return member
        raise ValueError(f"unknown speculative backend {name!r}; allowed: off, mtp, dflash, dflash2")


class PoolKind(str, enum.Enum):
    """The growing pools of the contract.

    ``MAIN``: the target model's KV (Main Text, page-major, the model's profile).  ``MTP``: the MTP
    head's KV (page-major, Main's profile and geometry).  ``DRAFT_FULL``: a DFlash draft model's
    full-attention KV (head-major, always BF16).  A ``str`` enum: ``PoolKind.MAIN == "main"``.
    """

    MAIN = "main"
    MTP = "mtp"
    DRAFT_FULL = "draft_full"

    @classmethod
    def parse(cls, name: "str | PoolKind") -> "PoolKind":
        """Resolve ``"main"``, ``"mtp"`` or ``"draft_full"`` (exact, lower case) or a member.

        Raises:
          ValueError: any other value, naming it and the allowed names.
        """
        if isinstance(name, PoolKind):
            return name
        for member in cls:
            if name == member.value:
                return member
        raise ValueError(f"unknown pool {name!r}; allowed: main, mtp, draft_full")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The selected speculative backend and the KV geometry it implies.

    Attributes:
      backend: a :class:`SpeculativeBackend` (off, MTP, DFlash or DFlash2; a name such as
        ``"mtp"`` is parsed).  Default off.
      draft_window: MTP draft window K in tokens (>= 1, default 1; at most ``max_context`` when
        planned); the MTP pool may lead Main by up to K - 1 tokens, which costs
        ``C * ceil((K - 1) / 64)`` extra MTP pages.  Used only by MTP.
      mtp_layers: MTP layers with persistent KV (>= 1, default 1): the layers of the MTP pool.
      draft_full_layers: DFlash/DFlash2 draft full-attention layers (default 0: no Draft Full pool).
      draft_kv_heads, draft_head_dim: Draft Full geometry (default ``None``: the Main model's).

    Raises:
      PlanBoundError: a count that is not an integer or is outside its range: ``draft_window`` in
        ``[1, MAX_CONTEXT]``, ``mtp_layers`` in ``[1, MAX_LAYERS]``, ``draft_full_layers`` in
        ``[0, MAX_LAYERS]``, ``draft_kv_heads`` and ``draft_head_dim`` in ``[1, 65536]``.
      ValueError: an unknown backend name.
    """

    backend: SpeculativeBackend = SpeculativeBackend.OFF
    draft_window: int = 1
    mtp_layers: int = 1
    draft_full_layers: int = 0
    draft_kv_heads: int | None = None
    draft_head_dim: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "backend", SpeculativeBackend.parse(self.backend))
        _int_at_least("draft_window", self.draft_window, 1, MAX_CONTEXT, "positions are int32")
        _int_at_least("mtp_layers", self.mtp_layers, 1, MAX_LAYERS)
        _int_at_least("draft_full_layers", self.draft_full_layers, 0, MAX_LAYERS)
        if self.draft_kv_heads is not None:
            _int_at_least("draft_kv_heads", self.draft_kv_heads, 1, MAX_KV_HEADS)
        if self.draft_head_dim is not None:
            _int_at_least("draft_head_dim", self.draft_head_dim, 1, MAX_HEAD_DIM)

    @property
    def has_draft_full(self) -> bool:
        """Whether the plan gets a Draft Full pool: backend DFlash or DFlash2 and ``draft_full_layers > 0``."""
        return self.backend in (SpeculativeBackend.DFLASH, SpeculativeBackend.DFLASH2) and self.draft_full_layers > 0

    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The pools this backend needs: ``(MAIN,)``, ``(MAIN, MTP)`` or ``(MAIN, DRAFT_FULL)``."""
        kinds = [PoolKind.MAIN]
        if self.backend is SpeculativeBackend.MTP:
            kinds.append(PoolKind.MTP)
        elif self.has_draft_full:
            kinds.append(PoolKind.DRAFT_FULL)
        return tuple(kinds)


@dataclasses.dataclass(frozen=True)
class ModelKVConfig:
    """The target model's full-attention KV geometry and the selected closed profile.

    ``ModelKVConfig(num_layers=16, num_kv_heads=2, head_dim=256, profile="k8v4")``.

    Attributes:
      num_layers: full-attention layers whose KV the Main pool stacks, in ``[1, MAX_LAYERS]``
        (4096).
      num_kv_heads: KV heads ``H`` per layer (after GQA grouping, not query heads), in
        ``[1, MAX_KV_HEADS]`` (65536).
      head_dim: head dim ``D`` (elements per K or V vector), in ``[1, MAX_HEAD_DIM]`` (65536); the
        profile may need a multiple of 64 (INT8-G64) or 16 (NVFP4-G16, K8V4).
      profile: the :class:`~ninfer_kv.profiles.KVProfile` of the Main and MTP pools (default BF16);
        a name such as ``"k8v4"`` or ``"fp8"`` is parsed and the canonical profile stored.

    Raises:
      PlanBoundError: a count that is not an integer or is out of range.
      ValueError: an unknown profile, or a head dim the profile cannot store.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    profile: KVProfile = KVProfile.BF16

    def __post_init__(self):
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        _int_at_least("num_layers", self.num_layers, 1, MAX_LAYERS)
        _int_at_least("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)
        _int_at_least("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        self.profile.check_head_dim(self.head_dim)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """One pool of a plan at a concrete ``M``.

    Attributes:
      kind: the :class:`PoolKind`.
      layout: the pool's :class:`~ninfer_kv.layout.PagedKVStorageLayout`.
      physical_pages: page groups ``N`` the pool allocates (``M``, or ``M + C * lead`` for MTP).
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
        """Bytes of one page group (64 tokens, every layer, head and plane) of this pool."""
        return self.layout.page_bytes

    @property
    def bytes(self) -> int:
        """Bytes of the pool's planes at ``physical_pages`` (what ``allocate`` creates; no block table)."""
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
class ExplicitCapacity:
    """Explicit ``kv_capacity`` policy: Main capacity in tokens.

    Planning takes ``M = ceil(kv_capacity / 64)`` Main page groups.

    Attributes:
      kv_capacity: Main capacity ``K`` in tokens, an integer >= 1.  :func:`plan_kv_cache` further
        requires ``K >= max_context`` and ``M_min <= ceil(K / 64) <= M_max`` (else
        :class:`PlanBoundError` naming the allowed token range).

    Raises:
      PlanBoundError: ``kv_capacity`` is not an integer >= 1.
    """

    kv_capacity: int

    def __post_init__(self):
        _int_at_least("kv_capacity", self.kv_capacity, 1)


@dataclasses.dataclass(frozen=True, init=False)
class AutomaticCapacity:
    """Automatic policy: free device bytes ``F`` after weights, minus headroom ``R``.

    Both take an integer, a whole-number float or a byte-size string (``AutomaticCapacity("40GiB",
    headroom_bytes="512MiB")``); the exact ``int`` counts are stored.  Planning picks
    ``M = min(M_max, M_min + floor((F - R - B_min) / B_step))``.

    Attributes:
      free_bytes: ``F``, device bytes free for the KV cache (after the weights), as an exact int.
      headroom_bytes: ``R``, bytes to leave unreserved (default 0), as an exact int.
        :func:`plan_kv_cache` raises ``ValueError`` when ``F < R + B_min``.

    Raises:
      ByteSizeTypeError: a bool or another type that is not a byte count.
      PlanBoundError: a count outside ``[0, INT64_MAX]``.
      ValueError: a float that is not whole, or a string that is not a byte size.
    """

    free_bytes: int
    headroom_bytes: int = 0

    def __init__(self, free_bytes: ByteSize, headroom_bytes: ByteSize = 0) -> None:
        object.__setattr__(self, "free_bytes", _byte_count("free_bytes", free_bytes))
        object.__setattr__(self, "headroom_bytes", _byte_count("headroom_bytes", headroom_bytes))

    @classmethod
    def from_device(cls, device=None, headroom_bytes: ByteSize = 0) -> "AutomaticCapacity":
        """Read F from ``device.memory_stats()`` (GPU). On CPU the caller must pass F explicitly.

        ``device`` may be one device, a sequence of devices, a ``jax.sharding.Mesh`` or a
        :class:`~ninfer_kv.mesh.KVMesh`: F is then the *minimum* free memory over them (every device
        of a mesh holds the same per-device share of the plan, so the tightest one decides).  In a
        multi-process program only this process's devices can be read; each process then plans
        from its own minimum, so pass the global minimum explicitly when the hosts differ.
        """
        devices = _devices_of(device)
        free = None
        for dev in devices:
            stats = dev.memory_stats() or {}
            if "bytes_limit" not in stats:
                raise ValueError(
                    f"device {dev} reports no memory_stats(); pass AutomaticCapacity(free_bytes=...) explicitly"
                )
            f = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            free = f if free is None else min(free, f)
        return cls(free_bytes=max(free, 0), headroom_bytes=headroom_bytes)


def _devices_of(device) -> list:
    """The addressable devices named by ``device`` (None: the first device)."""
    if device is None:
        return [jax.devices()[0]]
    mesh = getattr(device, "mesh", device)  # a KVMesh carries a jax Mesh
    if hasattr(mesh, "devices") and hasattr(mesh, "axis_names"):
        devices = list(np.asarray(mesh.devices).flat)
    elif isinstance(device, (list, tuple)):
        devices = list(device)
    else:
        return [device]
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not local:
        raise ValueError("none of the mesh's devices belongs to this process")
    return local


@dataclasses.dataclass(frozen=True)
class SequenceCapacityCurve:
    """Affine ``B(M) = b_min + (M - m_min) * b_step`` on ``[m_min, m_max]``.

    Attributes:
      m_min, m_max: the range of Main page groups ``M`` (``max(L, C)`` and ``C * L``).
      b_min: device bytes at ``m_min``: every pool's planes and block table plus the fixed part.
      b_step: device bytes each further Main page group adds (over every pool).
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
    """The production layout builder for a model, a speculative backend and (S, C).

    It is the single source of every pool's layout and page count as a function of ``M``; the
    capacity curve is computed from it and verified against it, and ``allocate`` builds the real
    device buffers from the same layouts.

    Args:
      model: the :class:`ModelKVConfig`.
      max_context: per-sequence ceiling ``S`` in tokens, in ``[1, MAX_CONTEXT]``.
      max_concurrency: execution rows ``C``, at least 1 and small enough that every pool's page
        IDs at ``M_min`` fit int32.
      speculative: the :class:`SpeculativeConfig` (default: backend off).
      fixed_bytes: bytes added to every ``B(M)`` (an integer, whole float or byte-size string).

    Attributes:
      model, speculative, max_context, max_concurrency, fixed_bytes: as given (validated; the
        byte count as an exact int).
      page_size: 64.
      logical_pages: ``L = ceil(S / 64)``.
      m_min, m_max: ``max(L, C)`` and ``C * L``.
      layouts: ``{PoolKind: PagedKVStorageLayout}`` of every pool the backend needs.

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
        if spec.backend is SpeculativeBackend.MTP and spec.draft_window > self.max_context:
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
            "max_concurrency", max_concurrency, 1, _max_concurrency(logical, lead), why + f" <= {MAX_PAGES} page groups"
        )
        self.fixed_bytes = _byte_count("fixed_bytes", fixed_bytes)
        self.page_size = PAGE_SIZE
        self.logical_pages = logical
        self.m_min = max(self.logical_pages, self.max_concurrency)
        self.m_max = self.max_concurrency * self.logical_pages
        self.layouts: dict[PoolKind, PagedKVStorageLayout] = {
            PoolKind.MAIN: PagedKVStorageLayout(model.profile, model.num_layers, model.num_kv_heads, model.head_dim)
        }
        if PoolKind.MTP in spec.pool_kinds():
            self.layouts[PoolKind.MTP] = PagedKVStorageLayout(
                model.profile, spec.mtp_layers, model.num_kv_heads, model.head_dim
            )
        if PoolKind.DRAFT_FULL in spec.pool_kinds():
            self.layouts[PoolKind.DRAFT_FULL] = PagedKVStorageLayout(
                KVProfile.BF16,
                spec.draft_full_layers,
                spec.draft_kv_heads or model.num_kv_heads,
                spec.draft_head_dim or model.head_dim,
                order=PlaneOrder.HEAD_MAJOR,
            )

    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The pools of this plan, Main first."""
        return tuple(self.layouts)

    def _check_m(self, m: int) -> int:
        m = _int_at_least("M", m, 1)
        if not self.m_min <= m <= self.m_max:
            raise ValueError(f"M={m} Main page groups is outside [{self.m_min}, {self.m_max}]")
        return m

    def _mtp_lead(self) -> int:
        """Pages per row the MTP pool may lead Main by: ``ceil((K - 1) / P)`` (0 without MTP)."""
        if self.speculative.backend is not SpeculativeBackend.MTP:
            return 0
        return ceil_div(self.speculative.draft_window - 1, PAGE_SIZE)

    def physical_pages(self, kind: PoolKind, m: int) -> int:
        """Physical page groups of pool ``kind`` at Main capacity ``M``."""
        if kind is PoolKind.MAIN or kind is PoolKind.DRAFT_FULL:
            return m
        return m + self.max_concurrency * self._mtp_lead()

    def max_m(self) -> int:
        """Largest ``M`` whose every pool's page IDs fit int32 (at most ``M_max``)."""
        return min(self.m_max, MAX_PAGES - self.max_concurrency * self._mtp_lead())

    def check_bounds(self, m: int) -> None:
        """Raise :class:`PlanBoundError` unless every pool at ``M`` has int32 page IDs and B(M) fits int64."""
        if m > self.max_m():
            raise PlanBoundError(
                "M",
                m,
                f"an integer in [{self.m_min}, {self.max_m()}]",
                f"every pool's page IDs must fit int32: at most {MAX_PAGES} page groups per pool",
            )
        _check_bytes("B(M)", self.device_bytes(m), f"the device bytes at M={m}")

    def pools(self, m: int) -> dict[PoolKind, PoolPlan]:
        """Every pool's :class:`PoolPlan` at ``M = m`` Main page groups.

        Raises:
          PlanBoundError: ``m`` is not an integer >= 1.
          ValueError: ``m`` outside ``[m_min, m_max]``.
        """
        m = self._check_m(m)
        return {
            kind: PoolPlan(kind, layout, self.physical_pages(kind, m), self.logical_pages, self.max_concurrency)
            for kind, layout in self.layouts.items()
        }

    def device_bytes(self, m: int) -> int:
        """B(M): every pool's buffers + every pool's block table + the fixed part."""
        return sum(p.bytes + p.table_bytes for p in self.pools(m).values()) + self.fixed_bytes

    def curve(self) -> SequenceCapacityCurve:
        """The affine curve, computed from two points of the builder and verified at a third."""
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
                    f"layout builder {describe_bytes(expect)}"
                )

    def allocate(self, m: int, *, device=None) -> dict[PoolKind, dict[str, jax.Array]]:
        """Allocate every pool's device planes at ``M`` (block tables are owned by the store)."""
        self.check_bounds(self._check_m(m))
        return {kind: p.layout.allocate(p.physical_pages, device=device) for kind, p in self.pools(m).items()}

    def allocated_bytes(self, m: int) -> int:
        """Bytes of really allocated planes plus tables and fixed part (for curve verification)."""
        total = 0
        for kind, planes in self.allocate(m).items():
            total += sum(int(a.nbytes) for a in planes.values())
            del planes
        total += sum(p.table_bytes for p in self.pools(m).values())
        return total + self.fixed_bytes

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


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """A resolved plan: ``M``, every pool at ``M``, and the capacity curve.

    Built by :func:`plan_kv_cache`; :class:`~ninfer_kv.store.KVStore` takes it.

    Attributes:
      builder: the :class:`KVPoolSetLayout` the plan was resolved with (``builder.allocate(m)``
        builds the planes).
      m: Main page groups ``M``.
      pools: ``{PoolKind: PoolPlan}`` at ``M``, Main first.
      curve: the :class:`SequenceCapacityCurve`.
    """

    builder: KVPoolSetLayout
    m: int
    pools: dict[PoolKind, PoolPlan]
    curve: SequenceCapacityCurve

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
        return self.builder.max_context

    @property
    def max_concurrency(self) -> int:
        """Execution rows ``C`` (block-table rows of every pool)."""
        return self.builder.max_concurrency

    @property
    def logical_pages(self) -> int:
        """``L = ceil(S / 64)``, logical pages per sequence (block-table columns)."""
        return self.builder.logical_pages

    def to_json(self) -> dict:
        """JSON-ready dict: sizes, ``M``, capacity, every pool, the curve and the device bytes.

        ``ninfer-kv plan --json`` prints this with ``policy``, ``notes`` (and ``draft_window``) added.
        """
        b = self.builder
        return {
            "page_size": PAGE_SIZE,
            "max_context": b.max_context,
            "max_concurrency": b.max_concurrency,
            "backend": b.speculative.backend.value,
            "logical_pages": b.logical_pages,
            "m_min": b.m_min,
            "m_max": b.m_max,
            "main_pages": self.m,
            "capacity_tokens": self.capacity_tokens,
            "pools": {k.value: p.to_json() for k, p in self.pools.items()},
            "curve": self.curve.to_json(),
            "fixed_bytes": b.fixed_bytes,
            "device_bytes": self.device_bytes,
        }


def _policy_bound_error(builder: KVPoolSetLayout, policy, m: int, exc: PlanBoundError) -> PlanBoundError:
    """Re-word a bound ``M`` violates in terms of the policy argument that chose ``M``."""
    curve = builder.curve()
    _check_b_min(builder, curve)
    limit = min(builder.max_m(), builder.m_min + (INT64_MAX - curve.b_min) // curve.b_step)
    why = f"it gives M = {m} Main page groups, beyond the largest valid M = {limit} ({exc.why})"
    if isinstance(policy, ExplicitCapacity):
        return PlanBoundError("kv_capacity", policy.kv_capacity, f"at most {limit * PAGE_SIZE} tokens", why)
    most = policy.headroom_bytes + curve.bytes_at(limit) + curve.b_step - 1
    return PlanBoundError(
        "free_bytes", policy.free_bytes, f"at most {most} bytes for this plan, {format_bytes(most)}", why,
        shown=_shown_bytes(policy.free_bytes),
    )


def check_pool_bytes(layout: PagedKVStorageLayout, num_pages: int) -> int:
    """Check one pool of ``num_pages`` page groups: int32 page IDs, int64 bytes; returns its bytes."""
    _int_at_least("num_pages", num_pages, 1, MAX_PAGES, "page IDs are int32")
    total = layout.buffer_bytes(num_pages)
    if layout.page_bytes > INT64_MAX:
        raise PlanBoundError(
            "page_bytes", layout.page_bytes, f"at most {INT64_MAX} bytes",
            "one page group of layers x KV heads x head dim must fit int64; the geometry cannot be real",
            shown=_shown_bytes(layout.page_bytes),
        )
    if total > INT64_MAX:
        raise PlanBoundError(
            "num_pages", num_pages, f"an integer in [1, {INT64_MAX // layout.page_bytes}]",
            f"the pool's bytes, {describe_bytes(layout.page_bytes)} per page group, must fit int64",
        )
    return total


def _check_b_min(builder: KVPoolSetLayout, curve: SequenceCapacityCurve) -> None:
    if curve.b_min > INT64_MAX:
        raise PlanBoundError(
            "B_min", curve.b_min, f"at most {INT64_MAX} bytes",
            "the device bytes at M_min = max(L, C)"
            + (f", fixed_bytes={builder.fixed_bytes} included," if builder.fixed_bytes else "")
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


def plan_kv_cache(
    model: ModelKVConfig,
    *,
    max_context: int,
    max_concurrency: int,
    policy: "ExplicitCapacity | AutomaticCapacity",
    speculative: SpeculativeConfig | None = None,
    fixed_bytes: ByteSize = 0,
) -> KVPlan:
    """Resolve ``policy`` to a :class:`KVPlan` for ``model`` under (S, C) and the backend.

    Args:
      model: the :class:`ModelKVConfig`.
      max_context: per-sequence ceiling ``S`` in tokens.
      max_concurrency: execution rows ``C`` (sequences resident at once).
      policy: :class:`ExplicitCapacity` (tokens) or :class:`AutomaticCapacity` (free bytes).
      speculative: the :class:`SpeculativeConfig` (default: backend off, Main pool only).
      fixed_bytes: bytes added to every ``B(M)`` (an integer, whole float or byte-size string).

    Planning allocates nothing (``plan.builder.allocate(plan.m)`` does).

    Raises:
      PlanBoundError: a value outside its bounds, worded in terms of the argument that caused it
        (``kv_capacity`` or ``free_bytes`` when the chosen ``M`` is too large).
      ValueError: ``AutomaticCapacity`` with ``free_bytes < headroom_bytes + B_min``.
      TypeError: a policy of another type.
    """
    builder = KVPoolSetLayout(model, max_context, max_concurrency, speculative, fixed_bytes)
    m = builder.resolve(policy)
    try:
        builder.check_bounds(m)
    except PlanBoundError as exc:
        raise _policy_bound_error(builder, policy, m, exc) from None
    return KVPlan(builder=builder, m=m, pools=builder.pools(m), curve=builder.curve())


# -- planning over a device mesh -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshKVPlan:
    """A plan over a ``data x model`` device mesh (see :mod:`ninfer_kv.mesh`).

    Attributes:
      mesh: the :class:`~ninfer_kv.mesh.MeshSpec`.
      model: the model as given (all ``H`` KV heads).
      device: the plan of **one device**: ``H_local`` heads (``H / T``, or 1 replicated head),
        ``C_local = C / D`` rows, ``M_local`` Main page groups; its ``B(M)`` curve is the per-device
        curve under the sharding and its ``device_bytes`` what each device allocates.
      shard: the plan of one **data shard** as the host bookkeeping sees it (every stored head of
        the model axis, the same ``C_local`` and ``M_local``): one ``KVStore`` per data shard uses it.
      single_device_bytes: ``B`` of one device holding the same total capacity and concurrency
        unsharded (``None`` where that exceeds a one-device plan's bounds).
    """

    mesh: "object"
    model: ModelKVConfig
    device: KVPlan
    shard: KVPlan
    single_device_bytes: int | None

    @property
    def m_local(self) -> int:
        """Main page groups per data shard."""
        return self.device.m

    @property
    def max_concurrency(self) -> int:
        """Total execution rows over the mesh, ``D * C_local``."""
        return self.device.max_concurrency * self.mesh.data

    @property
    def max_context(self) -> int:
        """The per-sequence ceiling ``S`` in tokens."""
        return self.device.max_context

    @property
    def logical_pages(self) -> int:
        """``L = ceil(S / 64)``, logical pages per sequence."""
        return self.device.logical_pages

    @property
    def capacity_tokens(self) -> int:
        """Main capacity over the whole mesh, ``D * M_local * P``."""
        return self.mesh.data * self.device.capacity_tokens

    @property
    def device_bytes(self) -> int:
        """Bytes each device allocates, ``B(M_local)`` of the per-device curve."""
        return self.device.device_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes over the whole mesh, ``D * T * device_bytes``."""
        return self.mesh.size * self.device_bytes

    @property
    def head_replication(self) -> int:
        """How many times each KV head is stored: ``T / H`` when ``H < T``, else 1."""
        return self.mesh.head_replication(self.model.num_kv_heads)

    def to_json(self) -> dict:
        """JSON-ready dict: mesh, heads per device, rows and pages per data shard, capacity and bytes.

        ``per_device`` is :meth:`KVPlan.to_json` of one device's plan; ``ninfer-kv plan --mesh ...
        --json`` prints this with ``policy`` added.
        """
        return {
            "mesh": self.mesh.to_json(),
            "kv_heads": self.model.num_kv_heads,
            "kv_heads_per_device": self.device.pools[PoolKind.MAIN].layout.num_kv_heads,
            "head_replication": self.head_replication,
            "max_concurrency": self.max_concurrency,
            "rows_per_data_shard": self.device.max_concurrency,
            "main_pages_per_data_shard": self.m_local,
            "capacity_tokens": self.capacity_tokens,
            "per_device": self.device.to_json(),
            "device_bytes": self.device_bytes,
            "total_bytes": self.total_bytes,
            "single_device_bytes": self.single_device_bytes,
        }


def plan_kv_cache_mesh(
    model: ModelKVConfig,
    mesh,
    *,
    max_context: int,
    max_concurrency: int,
    policy: "ExplicitCapacity | AutomaticCapacity",
    speculative: SpeculativeConfig | None = None,
    fixed_bytes: ByteSize = 0,
) -> MeshKVPlan:
    """Resolve ``policy`` for ``model`` sharded over ``mesh`` (a ``MeshSpec``, its text or a ``KVMesh``).

    ``max_concurrency`` is the total ``C`` (a multiple of ``D``); ``ExplicitCapacity.kv_capacity``
    is the total Main capacity over the data shards (each shard gets ``ceil(ceil(K / P) / D)``
    pages); ``AutomaticCapacity.free_bytes`` and ``fixed_bytes`` are per device (take F from
    :meth:`AutomaticCapacity.from_device` over the mesh: the minimum over its devices).
    """
    from .mesh import MeshSpec

    spec_mesh = MeshSpec.parse(getattr(mesh, "spec", mesh))
    speculative = speculative or SpeculativeConfig()
    c_local = spec_mesh.local_concurrency(_int_at_least("max_concurrency", max_concurrency, 1))
    spec_mesh.check_heads(model.num_kv_heads)
    draft_heads = speculative.draft_kv_heads or model.num_kv_heads
    if speculative.has_draft_full:
        spec_mesh.check_heads(draft_heads, "draft_kv_heads")

    def geometry(heads_of):
        m = dataclasses.replace(model, num_kv_heads=heads_of(model.num_kv_heads))
        s = speculative
        if speculative.has_draft_full:
            s = dataclasses.replace(speculative, draft_kv_heads=heads_of(draft_heads))
        return m, s

    dev_model, dev_spec = geometry(spec_mesh.local_heads)
    shard_model, shard_spec = geometry(spec_mesh.stored_heads)
    local_policy = policy
    if isinstance(policy, ExplicitCapacity):
        m_local = ceil_div(ceil_div(policy.kv_capacity, PAGE_SIZE), spec_mesh.data)
        local_policy = ExplicitCapacity(m_local * PAGE_SIZE)
    try:
        device = plan_kv_cache(dev_model, max_context=max_context, max_concurrency=c_local, policy=local_policy,
                               speculative=dev_spec, fixed_bytes=fixed_bytes)
    except PlanBoundError as exc:
        if isinstance(policy, ExplicitCapacity) and exc.name == "kv_capacity":
            b = KVPoolSetLayout(dev_model, max_context, c_local, dev_spec, fixed_bytes)
            d, p = spec_mesh.data, PAGE_SIZE
            lo, hi = max(max_context, (b.m_min - 1) * d * p + 1), b.max_m() * d * p
            raise PlanBoundError(
                "kv_capacity", policy.kv_capacity, f"in [{lo}, {hi}] tokens",
                f"the total over {d} data shards, each taking ceil(ceil(K/P)/D) pages in "
                f"[M_min={b.m_min}, M_max={b.max_m()}] at max_context={max_context}, C_local={c_local}",
            ) from None
        raise
    shard = plan_kv_cache(shard_model, max_context=max_context, max_concurrency=c_local,
                          policy=ExplicitCapacity(device.m * PAGE_SIZE), speculative=shard_spec)
    single = None
    try:
        one = KVPoolSetLayout(model, max_context, c_local * spec_mesh.data, speculative, fixed_bytes)
        m_total = device.m * spec_mesh.data
        one.check_bounds(m_total)
        single = one.device_bytes(m_total)
    except (PlanBoundError, ValueError):
        single = None
    return MeshKVPlan(mesh=spec_mesh, model=model, device=device, shard=shard, single_device_bytes=single)
