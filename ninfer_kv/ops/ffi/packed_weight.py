"""Weights packed once for the FFI's packed products (:func:`ninfer_kv.ops.ffi.products.matmul_bf16_packed`).

A :class:`PackedWeight` holds an ``nn.Linear`` weight ``w (N, K)`` (bfloat16) in the layout the
kernel (``ffi/src/gemm_packed.cc``) streams: tiles of 64 output columns, each tile one contiguous
run over K with the bfloat16 pairs of a column side by side::

    data[t, p, 2 * c + e] = w[64 * t + c, 2 * p + e]      data: (ceil(N / 64), ceil(K / 2), 128)

zero past N and K, bfloat16 denormals flushed to zero (sign kept; the products read them as zero
anyway).  It is a pytree (one array leaf, N and K static), so it can sit in a params dict and
pass through ``jax.jit``.  This module needs no FFI library.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["TILE_COLS", "PackedWeight", "pack_bf16_weight", "unpack_bf16_weight"]

TILE_COLS = 64
"""Output columns per tile of the packed layout."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A bfloat16 weight ``(n, k)`` in the packed-tile layout (see the module docstring)."""

    data: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape ``(N, K)``."""
        return (self.n, self.k)

    @property
    def dtype(self):
        return jnp.bfloat16


def _packed_dims(n: int, k: int) -> tuple[int, int, int]:
    return (-(-n // TILE_COLS), -(-k // 2), 2 * TILE_COLS)


def pack_bf16_weight(w) -> PackedWeight:
    """``w (N, K)`` bfloat16 (N, K >= 1) in the packed-tile layout.

    Raises ``ValueError`` naming the bad dtype or shape.
    """
    w = jnp.asarray(w)
    if w.dtype != jnp.bfloat16:
        raise ValueError(f"pack_bf16_weight: w must be bfloat16, got {w.dtype}")
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"pack_bf16_weight: w must be (N, K) with N >= 1 and K >= 1, got shape {w.shape}")
    n, k = (int(d) for d in w.shape)
    tiles, pairs, _ = _packed_dims(n, k)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    bits = jnp.where((bits & 0x7F80) == 0, bits & 0x8000, bits)  # denormals -> signed zero
    bits = jnp.pad(bits, ((0, tiles * TILE_COLS - n), (0, 2 * pairs - k)))
    bits = bits.reshape(tiles, TILE_COLS, pairs, 2).transpose(0, 2, 1, 3).reshape(tiles, pairs, 2 * TILE_COLS)
    return PackedWeight(jax.lax.bitcast_convert_type(bits, jnp.bfloat16), n, k)


def unpack_bf16_weight(packed: PackedWeight) -> jax.Array:
    """The dense ``(N, K)`` bfloat16 weight of ``packed`` (denormals as the packing flushed them)."""
    tiles, pairs, _ = packed.data.shape
    w = packed.data.reshape(tiles, pairs, TILE_COLS, 2).transpose(0, 2, 1, 3).reshape(tiles * TILE_COLS, 2 * pairs)
    return w[: packed.n, : packed.k]
