"""Block-size configurations of the Pallas kernels (frozen dataclasses), their defaults and resolution.

A config only holds tuning knobs: it never changes results beyond floating-point accumulation
order.  Fields left ``None`` are resolved from the static problem shape by ``resolve`` (the
resolved value can be printed and reused).  The block sizes are the same for every kernel backend;
a backend's own compiler knobs travel in the ``compiler`` field (``None``: the backend's defaults;
for the Triton kernels a :class:`pallas_kernels.triton.config.TritonConfig`), which only the
backend reads and checks.

Every block extent is a power of two; the constructors reject anything else with a ``ValueError``
naming the field, the value and the allowed range.  Configs are hashable and usable as static
arguments.
"""

from __future__ import annotations

import dataclasses

import jax

from ninfer_kv.schema.geometry import PAGE_SIZE

from .tiles import next_pow2

__all__ = [
    "PagedAppendConfig",
    "CyclicAppendConfig",
    "PagedAttentionConfig",
    "CyclicAttentionConfig",
    "ResolvedAttention",
    "MAX_QUERY_ROWS",
    "check_int",
    "op_config",
    "resolve_interpret",
]

_MAX_BLOCK_Q = 128  # query tokens held by one attention program
MAX_QUERY_ROWS = 256  # query rows (tokens x GQA group) held by one attention program


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_int(owner: str, name: str, value, lo: int, hi: int, *, pow2: bool, allow_none: bool) -> None:
    """``ValueError`` naming ``owner.name``, the value and the range unless ``value`` is an int in ``[lo, hi]``
    (a power of two with ``pow2``; ``None`` passes with ``allow_none``)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi or (pow2 and not _is_pow2(value)):
        kind = "a power of two" if pow2 else "an integer"
        raise ValueError(f"{owner}.{name}={value!r} is invalid; it must be {kind} in [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True)
class _AppendConfig:
    """The knobs of an append kernel (see :class:`PagedAppendConfig`)."""

    block_t: int = 16
    compiler: object = None

    def __post_init__(self):
        check_int(type(self).__name__, "block_t", self.block_t, 1, 256, pow2=True, allow_none=False)

    def for_tokens(self, num_tokens: int) -> "_AppendConfig":
        """This config with ``block_t`` no larger than the next power of two of ``num_tokens``."""
        return dataclasses.replace(self, block_t=min(self.block_t, next_pow2(max(1, num_tokens))))


@dataclasses.dataclass(frozen=True)
class PagedAppendConfig(_AppendConfig):
    """Tuning of a paged append kernel (:func:`pallas_kernels.paged_append` on Triton).

    Attributes:
      block_t: tokens quantized and written by one program (power of two, 1..256). The grid is
        ``(B, ceil(T / block_t), H)``.
      compiler: the kernel backend's compiler knobs (``None``: its defaults).
    """


@dataclasses.dataclass(frozen=True)
class CyclicAppendConfig(_AppendConfig):
    """Tuning of a cyclic append kernel: the knobs of :class:`PagedAppendConfig`."""


@dataclasses.dataclass(frozen=True)
class ResolvedAttention:
    """Fully resolved attention block sizes (see :class:`PagedAttentionConfig`)."""

    block_q: int
    block_k: int
    k_splits: int
    compiler: object  # as the config holds it: the backend resolves its own defaults


@dataclasses.dataclass(frozen=True)
class _AttentionConfig:
    """The knobs of an attention kernel (see :class:`PagedAttentionConfig`)."""

    block_q: int | None = None
    block_k: int = 64
    k_splits: int | None = None
    compiler: object = None

    _min_block_k = PAGE_SIZE

    def __post_init__(self):
        owner = type(self).__name__
        check_int(owner, "block_q", self.block_q, 1, _MAX_BLOCK_Q, pow2=True, allow_none=True)
        check_int(owner, "block_k", self.block_k, self._min_block_k, 512, pow2=True, allow_none=False)
        check_int(owner, "k_splits", self.k_splits, 1, 1024, pow2=False, allow_none=True)

    def resolve(self, *, num_queries: int, group: int, head_dim: int, batch: int, kv_heads: int,
                max_keys: int) -> ResolvedAttention:
        """Resolve ``None`` fields for a problem of the given static shape.

        Args:
          num_queries: T, query tokens per row.
          group: Hq / H, query heads per KV head.
          head_dim: D (the block sizes do not depend on it; a backend's compiler defaults may).
          batch: B rows.
          kv_heads: H.
          max_keys: the most keys one row can see (table width * 64, or the cyclic span).
        """
        del head_dim
        if self.block_q is None:
            block_q = max(1, 64 // next_pow2(group))
        else:
            block_q = self.block_q
        block_q = min(block_q, next_pow2(num_queries))
        if block_q * group > MAX_QUERY_ROWS:
            raise ValueError(
                f"{type(self).__name__}: block_q={block_q} x group={group} gives {block_q * group} query rows per "
                f"program; at most {MAX_QUERY_ROWS} are supported (lower block_q)"
            )
        steps = max(1, -(-max_keys // self.block_k))
        if self.k_splits is None:
            programs = max(1, batch * kv_heads * -(-num_queries // block_q))
            k_splits = max(1, min(-(-512 // programs), steps // 4, 64))
        else:
            k_splits = min(self.k_splits, steps)
        return ResolvedAttention(block_q=block_q, block_k=self.block_k, k_splits=k_splits, compiler=self.compiler)


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig(_AttentionConfig):
    """Tuning of a paged attention kernel (:func:`pallas_kernels.paged_attention` on Triton).

    Attributes:
      block_q: query tokens per program (power of two, <= 128). All ``Hq / H`` query heads of a KV
        head are processed together, so a program holds ``block_q * Hq / H`` query rows (at most
        256; a backend may pad them, e.g. Triton to a power of two >= 16 for the tensor-core
        products). ``None``: as many tokens as fit 64 rows (at least one), never more than the
        next power of two of ``T``.
      block_k: keys per inner step (power of two, <= 512; paged: a multiple of the page size 64,
        each step looking up ``block_k / 64`` pages in the block table; cyclic: >= 16).
      k_splits: programs sharing one (row, KV head, query tile) along the context (flash decoding);
        their partial results are merged by a small combine step. ``None``: enough splits to give
        a GPU a few hundred programs, never more than the table has steps.
      compiler: the kernel backend's compiler knobs (``None``: its defaults).
    """

    _min_block_k = PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class CyclicAttentionConfig(_AttentionConfig):
    """Tuning of a cyclic attention kernel: the knobs of :class:`PagedAttentionConfig`.

    ``block_k`` (keys per step, read from ring slots) is any power of two in [16, 512].
    """

    _min_block_k = 16


def op_config(config, config_type: type):
    """``config``, or a default ``config_type()`` for ``None``; ``TypeError`` for another op's config."""
    config = config_type() if config is None else config
    if not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__name__}, got {type(config).__name__}")
    return config


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: run the Pallas interpreter iff the default JAX backend is the CPU."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret={interpret!r} is invalid; it must be True, False or None")
    return interpret
