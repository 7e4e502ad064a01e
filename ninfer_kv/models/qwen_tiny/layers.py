"""Building blocks of the example decoder: RMSNorm, rotary position embedding, SwiGLU MLP.

All functions are pure jnp and shape-polymorphic over leading axes.  Norms and the RoPE rotation
run in float32 and return the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rms_norm", "rope_frequencies", "apply_rope", "token_positions", "swiglu"]

_F32 = jnp.float32


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last axis, computed in float32."""
    xf = x.astype(_F32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + _F32(eps))
    return (xf * inv * gain.astype(_F32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim / 2`` (float32)."""
    return jnp.asarray(theta, _F32) ** (-jnp.arange(0, head_dim, 2, dtype=_F32) / _F32(head_dim))


def token_positions(start: jax.Array, length: int) -> jax.Array:
    """Absolute positions ``start[b] + t`` of a chunk: int32 ``(B,) -> (B, length)``."""
    return jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate ``x (B, T, heads, D)`` at integer ``positions (B, T)`` (half-split convention).

    Dimension ``i < D/2`` pairs with ``i + D/2``: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``
    with angle ``position * theta ** (-2i / D)``.
    """
    d = x.shape[-1]
    inv = rope_frequencies(d, theta)
    ang = positions.astype(_F32)[..., None] * inv  # (B, T, D/2)
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(_F32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """``(silu(x @ w_gate) * (x @ w_up)) @ w_down``."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
