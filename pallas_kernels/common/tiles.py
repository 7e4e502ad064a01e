"""Tiles of lanes and the arithmetic on them that every kernel backend shares.

A kernel works on 2-D tiles ``(tokens or keys, lanes)`` of the D-lane vectors of K, V and Q.
:class:`Cols` says which lanes of a vector a tile covers (all lanes, one group, the even or the
odd lanes, or each lane's group index) and how many of them are real; :class:`Lanes` is a
backend's rule for how wide a tile must be (the Triton lowering wants powers of two, at least 16
lanes for a product operand), so the codec tiles (:mod:`pallas_kernels.common.codec_tiles`) ask
for lanes without knowing any backend's rule.  When a tile is wider than its real lanes (head
dims such as 80, 96, 160 or 192), ``Cols.mask`` marks the real ones: loads fill the padding with
zeros and stores skip it.

The reductions here work on whole tiles without reshapes (a group's maximum is a masked reduction
over the tile, group values are spread back over the lanes with a select chain), which every
Pallas lowering accepts.  NaN is detected on the bits and propagated explicitly, never through
``max`` (the Triton lowering of ``max`` ignores NaN operands).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

import ninfer_kv.ops.codecs as codecs

__all__ = [
    "Cols",
    "Lanes",
    "and_masks",
    "next_pow2",
    "pow2_at_least",
    "div_where",
    "group_amax",
    "spread",
    "dot",
]

F32 = jnp.float32


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)``."""
    return next_pow2(max(int(n), int(floor)))


@dataclasses.dataclass(frozen=True)
class Cols:
    """Lanes ``(start + stride * i) // div`` for ``i < n``.

    Only ``i < count`` are real lanes (``count`` defaults to ``n``); the others pad the tile to the
    width the backend needs (:class:`Lanes`).
    """

    start: int
    stride: int
    n: int
    div: int = 1
    count: int | None = None

    @property
    def real(self) -> int:
        """The number of real lanes (the first ``real`` of the tile)."""
        return self.n if self.count is None else self.count

    def index(self) -> jax.Array:
        """The lane indices as an int32 ``(1, n)`` row (built from an iota inside a kernel).

        Padding lanes all name the first lane past the real ones (``start + stride * count``):
        one past the end of the vector, never loaded or stored (masked), and outside the array,
        so that the interpreter's scatter drops them rather than racing with a real lane.
        """
        i = jax.lax.broadcasted_iota(jnp.int32, (1, self.n), 1)
        if self.real < self.n:
            i = jnp.minimum(i, self.real)
        lanes = self.start + self.stride * i
        if self.div != 1:
            lanes = jax.lax.div(lanes, jnp.int32(self.div))
        return lanes

    def mask(self) -> jax.Array | None:
        """bool ``(1, n)``: the real lanes; ``None`` when every lane is real."""
        if self.real == self.n:
            return None
        return jax.lax.broadcasted_iota(jnp.int32, (1, self.n), 1) < self.real


@dataclasses.dataclass(frozen=True)
class Lanes:
    """The lanes of one kernel's tiles: its head dim and its backend's padding rule.

    ``width(n)`` is how many lanes a tile holding ``n`` real lanes has (``>= n``); a tile that is
    an operand of a product has at least ``operand_floor`` lanes.  A backend builds one per kernel
    (the Triton backend: powers of two, operands of at least 16 lanes).
    """

    head_dim: int
    width: Callable[[int], int]
    operand_floor: int = 1

    def cols(self, start: int, stride: int, count: int, *, div: int = 1, operand: bool = False) -> Cols:
        """``count`` real lanes ``(start + stride * i) // div`` in a tile as wide as the rule says.

        ``operand``: the tile is an operand of a product (at least ``operand_floor`` lanes).
        """
        n = self.width(max(count, self.operand_floor) if operand else count)
        return Cols(start, stride, n, div, count)


def and_masks(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    """``a & b`` (broadcasting), where ``None`` means all true."""
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def div_where(x: jax.Array, s: jax.Array, ok: jax.Array) -> jax.Array:
    """Correctly rounded ``x / s`` where ``ok`` (the scale is usable), 0 elsewhere.

    :func:`ninfer_kv.ops.codecs.div_rn` returns the IEEE quotient whatever the compiler does to a
    division (XLA rewrites ``x / broadcast(s)`` into ``x * (1 / s)``; Triton may divide
    approximately), so the codes are the same in the interpreter, on a GPU and in the reference.
    Lanes outside ``ok`` divide 0 by 1, so no NaN or infinity reaches a later integer conversion.
    """
    return jnp.where(ok, codecs.div_rn(jnp.where(ok, x, 0.0), jnp.where(ok, s, 1.0)), 0.0)


def group_amax(x: jax.Array, group: int, groups: int) -> list[jax.Array]:
    """``max |x|`` per group of ``group`` consecutive lanes of ``x (n, m)``, NaN propagated; ``(n,)`` each.

    The first ``groups`` groups only.  Each group is a masked reduction over the whole tile (no
    reshape); NaN lanes enter the maximum as 0 and a group holding one gets NaN afterwards (the
    Triton lowering of ``max`` ignores NaN operands, XLA's CPU one does not always propagate them).
    """
    gid = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, x.shape[1]), 1), jnp.int32(group))
    nan = codecs.is_nan_bits(x)
    a = jnp.where(nan, 0.0, jnp.abs(x))
    nan_f = nan.astype(F32)
    out = []
    for g in range(groups):
        in_g = gid == g
        amax = jnp.max(jnp.where(in_g, a, 0.0), axis=1)
        out.append(codecs.propagate_nan(amax, jnp.max(jnp.where(in_g, nan_f, 0.0), axis=1) > 0))
    return out


def spread(values: list[jax.Array], group: int, lanes: int, dtype) -> jax.Array:
    """``(n, lanes)`` tile whose lane ``i`` holds ``values[i // group]`` (a select chain, no reshape).

    Lanes past ``len(values) * group`` hold 0.
    """
    gid = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, lanes), 1), jnp.int32(group))
    out = jnp.zeros((values[0].shape[0], lanes), dtype)
    for g, v in enumerate(values):
        out = jnp.where(gid == g, v.astype(dtype)[:, None], out)
    return out


def dot(a: jax.Array, b: jax.Array, *, transpose_b: bool = False) -> jax.Array:
    """``a @ b`` (``a @ b.T`` with ``transpose_b``) accumulated in float32; float32 operands at full precision."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)
