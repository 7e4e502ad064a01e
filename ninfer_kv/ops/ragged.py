"""Ragged batches as one query per row: the generic form of the ragged ops.

A ragged call holds the tokens of ``R`` rows one after another on one token axis of length ``N``;
row ``r`` owns tokens ``[e[r], e[r + 1])`` where ``e`` is ``query_starts`` clamped into ``[0, N]``
and made non-decreasing by a running maximum (:func:`effective_starts`; concrete inputs are checked
to need neither).  Token ``i`` of row ``r`` sits at position ``positions[r] + i - e[r]``; a token of
no row (before ``e[0]`` or from ``e[R]`` on) is padding.

Every ragged op equals its rectangular op over ``N`` rows of one token each
(:func:`token_rows`): token ``i`` becomes a row of the same table row, at its own position, with
its row's ``kv_lens`` (attention) and ``valid = 1`` (append; padding tokens get an out-of-range
table row, which the op contract makes inert).  That is how backends without a native ragged
kernel run the ragged ops, and with the reference backend it is the ragged ops' float32
reference.  A native kernel (the FFI's, the Pallas and the Mosaic TPU ones) instead walks each
row's queries in blocks, as the rectangular form walks a row of that many queries.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from .views import PagedKVBatchLayerView

__all__ = ["effective_starts", "TokenRows", "token_rows", "append_by_token", "attention_by_token"]


def effective_starts(query_starts: jax.Array, num_tokens: int) -> jax.Array:
    """``query_starts (R + 1,)`` clamped into ``[0, N]``, then its running maximum (rows never overlap)."""
    s = jnp.clip(jnp.asarray(query_starts, jnp.int32), 0, num_tokens)
    return jax.lax.cummax(s, axis=0)


class TokenRows(NamedTuple):
    """Per-token rows of a ragged call: each ``int32 (N,)``."""

    row: jax.Array  # the row owning token i, R for padding
    table_rows: jax.Array  # its table row; -1 (inert) for padding
    positions: jax.Array  # its position
    real: jax.Array  # 1 for a token of a row, 0 for padding


def token_rows(table_rows: jax.Array, positions: jax.Array, query_starts: jax.Array, num_tokens: int) -> TokenRows:
    """The row, table row and position of every token of a ragged call."""
    r = table_rows.shape[0]
    e = effective_starts(query_starts, num_tokens)
    i = jnp.arange(num_tokens, dtype=jnp.int32)
    # the row of token i: the number of rows whose end is <= i, among those starting at or before it
    row = jnp.searchsorted(e[1:], i, side="right").astype(jnp.int32)
    real = (i >= e[0]) & (row < r)
    safe = jnp.clip(row, 0, r - 1)
    pos = jnp.asarray(positions, jnp.int32)[safe] + i - e[safe]
    rows = jnp.where(real, jnp.asarray(table_rows, jnp.int32)[safe], -1)
    return TokenRows(jnp.where(real, row, r), rows, jnp.where(real, pos, 0), real.astype(jnp.int32))


def append_by_token(paged_append: Callable) -> Callable:
    """The ragged append of a backend's rectangular ``paged_append`` (one token per row)."""

    def ragged(view: PagedKVBatchLayerView, table_rows: jax.Array, positions: jax.Array, k: jax.Array,
               v: jax.Array, query_starts: jax.Array) -> PagedKVBatchLayerView:
        """The ragged append: token ``i`` is row ``i`` of one token."""
        tok = token_rows(table_rows, positions, query_starts, k.shape[0])
        return paged_append(view, tok.table_rows, tok.positions, k[:, None], v[:, None], tok.real)

    return ragged


def attention_by_token(paged_attention: Callable) -> Callable:
    """The ragged attention of a backend's rectangular ``paged_attention`` (one query per row)."""

    def ragged(q: jax.Array, view: PagedKVBatchLayerView, table_rows: jax.Array, positions: jax.Array,
               kv_lens: jax.Array, query_starts: jax.Array, *, sm_scale: float | None = None,
               **variant) -> jax.Array:
        """The ragged attention: query ``i`` is row ``i`` of one query (``variant``: the attention
        options, passed on as given)."""
        tok = token_rows(table_rows, positions, query_starts, q.shape[0])
        lens = jnp.where(tok.real == 1, jnp.asarray(kv_lens, jnp.int32)[jnp.clip(tok.row, 0, table_rows.shape[0] - 1)], 0)
        out = paged_attention(q[:, None], view, tok.table_rows, tok.positions, lens, sm_scale=sm_scale, **variant)
        return out[:, 0]

    return ragged
