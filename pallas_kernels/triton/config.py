"""The Triton backend's compiler knobs and tile rules.

:class:`TritonConfig` is what the ``compiler`` field of the op configs
(:mod:`pallas_kernels.common.config`) holds for the Triton kernels: warps per program and
software-pipelining stages, ``None`` meaning the kernel's default.  The tile rules are the Triton
lowering's: every tile extent is a power of two, and an operand of a product (a tensor-core
``dot``) has at least 16 rows and 16 lanes.
"""

from __future__ import annotations

import dataclasses

from ..common.config import check_int
from ..common.tiles import Lanes, next_pow2, pow2_at_least

__all__ = ["TritonConfig", "triton_config", "lanes", "query_rows", "MIN_DOT"]

MIN_DOT = 16  # the least extent of a product operand's dimensions


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Triton compiler knobs of one kernel (the ``compiler`` field of an op config).

    Attributes:
      num_warps: warps per program (power of two, 1..32); ``None``: appends 4, attention 4 for
        head dim <= 128 and at most 64 query rows, else 8.
      num_stages: software-pipelining depth (1..8); ``None``: appends 1, attention 2 (the key loop),
        3 for a decode tile (at most 16 query rows: one token's GQA group) of head dim > 128.  A
        decode program is memory-bound and holds a small query tile, so it affords a third stage of
        K/V tiles in flight; at two stages ptxas 13 caps the bf16 head-major D 256 decode kernel at
        128 registers and spills (bench/deviceless_gpu.py), at three no decode kernel spills.
    """

    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        check_int("TritonConfig", "num_warps", self.num_warps, 1, 32, pow2=True, allow_none=True)
        check_int("TritonConfig", "num_stages", self.num_stages, 1, 8, pow2=False, allow_none=True)

    def _with_defaults(self, num_warps: int, num_stages: int) -> "TritonConfig":
        return TritonConfig(num_warps if self.num_warps is None else self.num_warps,
                            num_stages if self.num_stages is None else self.num_stages)

    def for_append(self) -> "TritonConfig":
        """Every field set, with the append kernels' defaults."""
        return self._with_defaults(4, 1)

    def for_attention(self, head_dim: int, rows: int) -> "TritonConfig":
        """Every field set, with the attention kernels' defaults for head dim ``head_dim`` and
        ``rows`` query rows per program (:func:`query_rows`)."""
        decode_tile = rows <= MIN_DOT
        return self._with_defaults(4 if head_dim <= 128 and rows <= 64 else 8,
                                   3 if decode_tile and head_dim > 128 else 2)


def triton_config(config) -> TritonConfig:
    """The :class:`TritonConfig` of an op config (``compiler`` ``None``: all defaults).

    Raises ``TypeError`` when ``compiler`` holds another backend's knobs.
    """
    compiler = config.compiler
    if compiler is None:
        return TritonConfig()
    if not isinstance(compiler, TritonConfig):
        raise TypeError(
            f"{type(config).__name__}.compiler must be a TritonConfig or None for the Triton kernels, "
            f"got {type(compiler).__name__}"
        )
    return compiler


def lanes(head_dim: int) -> Lanes:
    """The Triton tile rule for head dim ``head_dim``: powers of two, product operands >= 16 lanes."""
    return Lanes(head_dim, next_pow2, MIN_DOT)


def query_rows(block_q: int, group: int) -> int:
    """Query rows of one attention program: ``block_q * group`` padded to a power of two >= 16."""
    return pow2_at_least(block_q * group, MIN_DOT)
