"""What a deployment states: the model's KV geometry, the speculative method and the capacity policy."""

from __future__ import annotations

import dataclasses

from ..schema.kinds import PoolKind, SpeculativeMethod
from ..schema.profiles import KVProfile
from ..schema.sizes import ByteSize
from .pool_specs import enabled_pools
from .rings import WindowRings
from .bounds import MAX_CONTEXT, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS, _byte_count, _int_at_least

__all__ = ["SpeculativeConfig", "ModelKVConfig", "ExplicitCapacity", "AutomaticCapacity"]

@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The selected speculative method and the KV geometry it implies.

    Attributes:
      method: a :class:`SpeculativeMethod` (off, MTP, DFlash or DFlash2; a name such as
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
      ValueError: an unknown method name.
    """

    method: SpeculativeMethod = SpeculativeMethod.OFF
    draft_window: int = 1
    mtp_layers: int = 1
    draft_full_layers: int = 0
    draft_kv_heads: int | None = None
    draft_head_dim: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "method", SpeculativeMethod.parse(self.method))
        _int_at_least("draft_window", self.draft_window, 1, MAX_CONTEXT, "positions are int32")
        _int_at_least("mtp_layers", self.mtp_layers, 1, MAX_LAYERS)
        _int_at_least("draft_full_layers", self.draft_full_layers, 0, MAX_LAYERS)
        if self.draft_kv_heads is not None:
            _int_at_least("draft_kv_heads", self.draft_kv_heads, 1, MAX_KV_HEADS)
        if self.draft_head_dim is not None:
            _int_at_least("draft_head_dim", self.draft_head_dim, 1, MAX_HEAD_DIM)

    @property
    def has_draft_full(self) -> bool:
        """Whether the plan gets a Draft Full pool: method DFlash or DFlash2 and ``draft_full_layers > 0``."""
        return self.method in (SpeculativeMethod.DFLASH, SpeculativeMethod.DFLASH2) and self.draft_full_layers > 0

    def pool_kinds(self) -> tuple[PoolKind, ...]:
        """The pools this method needs: ``(MAIN,)``, ``(MAIN, MTP)`` or ``(MAIN, DRAFT_FULL)``
        (the ``enabled`` rules of :data:`~ninfer_kv.planning.pool_specs.POOL_SPECS`)."""
        return enabled_pools(self)


@dataclasses.dataclass(frozen=True)
class ModelKVConfig:
    """The target model's KV geometry and the selected closed profile.

    ``ModelKVConfig(num_layers=16, num_kv_heads=2, head_dim=256, profile="k8v4")``; a model with
    sliding-window layers names them in ``rings``:
    ``ModelKVConfig(4, 8, 256, rings=WindowRings(num_layers=20, window=1024))`` (Gemma-3-shaped: 4
    global layers in the Main pool, 20 windowed layers in per-row rings, :mod:`.rings`).

    Attributes:
      num_layers: full-attention layers whose KV the Main pool stacks, in ``[1, MAX_LAYERS]``
        (4096).
      num_kv_heads: KV heads ``H`` per layer (after GQA grouping, not query heads), in
        ``[1, MAX_KV_HEADS]`` (65536).
      head_dim: head dim ``D`` (elements per K or V vector), in ``[1, MAX_HEAD_DIM]`` (65536); the
        profile may need a multiple of 64 (INT8-G64) or 16 (NVFP4-G16, K8V4).
      profile: the :class:`~ninfer_kv.schema.profiles.KVProfile` of the Main and MTP pools and of the
        window rings (default BF16); a name such as ``"k8v4"`` or ``"fp8"`` is parsed and the
        canonical profile stored.
      rings: the sliding-window layers kept in per-row rings (:class:`~ninfer_kv.planning.rings.WindowRings`,
        same KV heads and head dim), or ``None`` (default): every layer is in the Main pool.

    Raises:
      PlanBoundError: a count that is not an integer or is out of range.
      ValueError: an unknown profile, or a head dim the profile cannot store.
      TypeError: ``rings`` that is not a ``WindowRings`` or ``None``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    profile: KVProfile = KVProfile.BF16
    rings: WindowRings | None = None

    def __post_init__(self):
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        _int_at_least("num_layers", self.num_layers, 1, MAX_LAYERS)
        _int_at_least("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)
        _int_at_least("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        self.profile.check_head_dim(self.head_dim)
        if self.rings is not None and not isinstance(self.rings, WindowRings):
            raise TypeError(f"rings={self.rings!r} must be a WindowRings or None")


@dataclasses.dataclass(frozen=True)
class ExplicitCapacity:
    """Explicit ``kv_capacity`` policy: Main capacity in tokens.

    Planning takes ``M = ceil(kv_capacity / 64)`` Main pages.

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
