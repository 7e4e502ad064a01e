"""Block-size configurations of the Pallas kernels (frozen dataclasses) and their defaults.

A config only holds tuning knobs: it never changes results beyond floating-point accumulation
order.  Fields left ``None`` are resolved from the static problem shape by ``resolve`` (the
resolved value is again a config, with every field set, so it can be printed and reused).

Every block extent that becomes a tensor dimension inside a kernel must be a power of two (a
Pallas Triton requirement); the constructors reject anything else with a ``ValueError`` naming the
field, the value and the allowed range.  Configs are hashable and usable as static arguments.
"""

from __future__ import annotations

import dataclasses

from ninfer_kv.geometry import PAGE_SIZE

__all__ = [
    "PagedAppendConfig",
    "CyclicAppendConfig",
    "PagedAttentionConfig",
    "CyclicAttentionConfig",
    "ResolvedAttention",
]

_MAX_ROWS = 128  # query rows (tokens x GQA group) held by one attention program


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _check_int(owner: str, name: str, value, lo: int, hi: int, *, pow2: bool, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi or (pow2 and not _is_pow2(value)):
        kind = "a power of two" if pow2 else "an integer"
        raise ValueError(f"{owner}.{name}={value!r} is invalid; it must be {kind} in [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True)
class _AppendConfig:
    """The knobs of an append kernel (see :class:`PagedAppendConfig`)."""

    block_t: int = 16
    num_warps: int = 4
    num_stages: int = 1
    backend: str = "triton"

    def __post_init__(self):
        owner = type(self).__name__
        _check_int(owner, "block_t", self.block_t, 1, 256, pow2=True, allow_none=False)
        _check_int(owner, "num_warps", self.num_warps, 1, 32, pow2=True, allow_none=False)
        _check_int(owner, "num_stages", self.num_stages, 1, 8, pow2=False, allow_none=False)
        if not isinstance(self.backend, str):
            raise ValueError(f"{owner}.backend={self.backend!r} is invalid; it must be a backend name")

    def for_tokens(self, num_tokens: int) -> "_AppendConfig":
        """This config with ``block_t`` no larger than the next power of two of ``num_tokens``."""
        return dataclasses.replace(self, block_t=min(self.block_t, next_pow2(max(1, num_tokens))))


@dataclasses.dataclass(frozen=True)
class PagedAppendConfig(_AppendConfig):
    """Tuning of :func:`pallas_kernels.paged_append`.

    Attributes:
      block_t: tokens quantized and written by one program (power of two, 1..256). The grid is
        ``(B, ceil(T / block_t), H)``.
      num_warps: warps per program (1..32, power of two).
      num_stages: software-pipelining depth (1..8).
      backend: kernel backend name (see :mod:`pallas_kernels.backend`).
    """


@dataclasses.dataclass(frozen=True)
class CyclicAppendConfig(_AppendConfig):
    """Tuning of :func:`pallas_kernels.cyclic_append`: the knobs of :class:`PagedAppendConfig`."""


@dataclasses.dataclass(frozen=True)
class ResolvedAttention:
    """Fully resolved attention tuning (every field an int; see :class:`PagedAttentionConfig`)."""

    block_q: int
    block_k: int
    k_splits: int
    num_warps: int
    num_stages: int
    rows: int  # query rows per program: next_pow2(max(16, block_q * group))
    backend: str


@dataclasses.dataclass(frozen=True)
class _AttentionConfig:
    """The knobs of an attention kernel (see :class:`PagedAttentionConfig`)."""

    block_q: int | None = None
    block_k: int = 64
    k_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    backend: str = "triton"

    _min_block_k = PAGE_SIZE

    def __post_init__(self):
        owner = type(self).__name__
        _check_int(owner, "block_q", self.block_q, 1, _MAX_ROWS, pow2=True, allow_none=True)
        _check_int(owner, "block_k", self.block_k, self._min_block_k, 512, pow2=True, allow_none=False)
        _check_int(owner, "k_splits", self.k_splits, 1, 1024, pow2=False, allow_none=True)
        _check_int(owner, "num_warps", self.num_warps, 1, 32, pow2=True, allow_none=True)
        _check_int(owner, "num_stages", self.num_stages, 1, 8, pow2=False, allow_none=False)
        if not isinstance(self.backend, str):
            raise ValueError(f"{owner}.backend={self.backend!r} is invalid; it must be a backend name")

    def resolve(self, *, num_queries: int, group: int, head_dim: int, batch: int, kv_heads: int,
                max_keys: int) -> ResolvedAttention:
        """Resolve ``None`` fields for a problem of the given static shape.

        Args:
          num_queries: T, query tokens per row.
          group: Hq / H, query heads per KV head.
          head_dim: D.
          batch: B rows.
          kv_heads: H.
          max_keys: the most keys one row can see (table width * 64, or the cyclic span).
        """
        if self.block_q is None:
            block_q = max(1, 64 // next_pow2(group))
        else:
            block_q = self.block_q
        block_q = min(block_q, next_pow2(num_queries))
        rows = next_pow2(max(16, block_q * group))
        if rows > 256:
            raise ValueError(
                f"{type(self).__name__}: block_q={block_q} x group={group} gives {rows} query rows per "
                f"program; at most 256 are supported (lower block_q)"
            )
        steps = max(1, -(-max_keys // self.block_k))
        if self.k_splits is None:
            programs = max(1, batch * kv_heads * -(-num_queries // block_q))
            k_splits = max(1, min(-(-512 // programs), steps // 4, 64))
        else:
            k_splits = min(self.k_splits, steps)
        num_warps = self.num_warps if self.num_warps is not None else (4 if head_dim <= 128 else 8)
        return ResolvedAttention(
            block_q=block_q,
            block_k=self.block_k,
            k_splits=k_splits,
            num_warps=num_warps,
            num_stages=self.num_stages,
            rows=rows,
            backend=self.backend,
        )


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig(_AttentionConfig):
    """Tuning of :func:`pallas_kernels.paged_attention`.

    Attributes:
      block_q: query tokens per program (power of two). All ``Hq / H`` query heads of a KV head are
        processed together, so a program holds ``block_q * Hq / H`` query rows (padded to a power of
        two >= 16 for the tensor-core products). ``None``: as many tokens as fit 64 rows (at least
        one), never more than the next power of two of ``T``.
      block_k: keys per inner step (power of two, <= 512; paged: a multiple of the page size 64,
        each step looking up ``block_k / 64`` pages in the block table; cyclic: >= 16).
      k_splits: programs sharing one (row, KV head, query tile) along the context (flash decoding);
        their partial results are merged by a small combine step. ``None``: enough splits to give
        a GPU a few hundred programs, never more than the table has steps.
      num_warps: warps per program; ``None``: 4 for head dim <= 128, else 8.
      num_stages: software-pipelining depth of the key loop.
      backend: kernel backend name (see :mod:`pallas_kernels.backend`).
    """

    _min_block_k = PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class CyclicAttentionConfig(_AttentionConfig):
    """Tuning of :func:`pallas_kernels.cyclic_attention`: the knobs of :class:`PagedAttentionConfig`.

    ``block_k`` (keys per step, read from ring slots) is any power of two in [16, 512].
    """

    _min_block_k = 16
