"""The online-softmax arithmetic of attention, shared by every kernel backend.

A program visits its keys in steps and keeps, per query row, the running maximum ``m`` of the
scores, the running sum ``l`` of their exponentials and unnormalised accumulators (one per value
column of the V codec, :meth:`pallas_kernels.common.codec_tiles.CodecTile.columns`), all float32.
Visibility per (query, key) is ``key <= query position`` (and ``key > query position - window``
for a sliding window) on top of the keys the program loaded; a query with no visible key ends with
``l = 0`` and outputs zeros.  A context split over several programs is merged by
:func:`combine_splits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tiles import F32

__all__ = ["M_INIT", "compute_dtype_for", "visible_keys", "initial_state", "softmax_step", "normaliser",
           "combine_splits"]

M_INIT = -1e30  # initial running max: finite, so exp(m_old - m_new) never sees inf - inf


def compute_dtype_for(q_dtype) -> object:
    """bfloat16 products for bfloat16 queries, full-precision float32 products otherwise."""
    return jnp.bfloat16 if jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32


def visible_keys(j: jax.Array, qpos: jax.Array, key_ok: jax.Array, window: int | None) -> jax.Array:
    """bool ``(rows, keys)``: key positions ``j (keys,)`` that the queries at ``qpos (rows,)`` see.

    ``key_ok (keys,)`` are the keys the program loaded; ``window`` (or ``None``) the sliding window.
    """
    visible = key_ok[None, :] & (j[None, :] <= qpos[:, None])
    if window is not None:
        visible = visible & (j[None, :] > qpos[:, None] - window)
    return visible


def initial_state(rows: int, widths) -> tuple:
    """``(m, l, *accs)`` before the first key: ``M_INIT``, 0 and zero ``(rows, width)`` accumulators."""
    return (jnp.full((rows,), M_INIT, F32), jnp.zeros((rows,), F32), *[jnp.zeros((rows, w), F32) for w in widths])


def softmax_step(m: jax.Array, l: jax.Array, accs: list, s: jax.Array, visible: jax.Array):
    """One step of the online softmax over the scores ``s (rows, keys)`` (float32, already scaled).

    Returns ``(m, l, accs, p)``: the new running max and sum, the accumulators rescaled to the new
    maximum, and the probabilities ``p (rows, keys)`` to accumulate ``p @ v`` with (0 where not
    ``visible``).
    """
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l_new = l * alpha + jnp.sum(p, axis=1)
    return m_new, l_new, [a * alpha[:, None] for a in accs], p


def normaliser(l: jax.Array) -> jax.Array:
    """``1 / l`` as a ``(..., 1)`` column, 0 where ``l`` is 0 (no visible key)."""
    return jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)[..., None]


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Merge per-split partials: acc ``(S, ..., D)``, m and l ``(S, ...)`` -> normalised ``(..., D)``."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    o = jnp.sum(w[..., None] * acc, axis=0)
    return (o * normaliser(l_all)).astype(dtype)
