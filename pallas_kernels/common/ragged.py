"""Ragged calls cut into blocks: which rows' tokens each program of a native ragged kernel handles.

A ragged call (:mod:`ninfer_kv.ops.ragged`) holds the tokens of ``R`` rows on one token axis of
length ``N``: row ``r`` owns tokens ``[e[r], e[r + 1])`` (``e`` the effective starts) at positions
``positions[r] + i - e[r]``.  The native kernels run a static grid over *blocks*, each a run of
consecutive tokens of one row, so each program walks its row's pages once for all its tokens.
The grid's size is a bound that depends only on the static ``(R, N)`` and the block size; blocks
past the real ones are *inert* (``rows = -1``, ``counts = 0``, ``kv_lens = 0``): the kernels'
out-of-range rules make them read and write nothing.

A round is split by the length of its rows (tpu-inference calls this the round's distribution):

* **decode rows** (exactly one token): one block each, of one token (:func:`decode_blocks`).  Their
  programs are the rectangular decode kernel's programs: the same query tile (the GQA group of one
  token), the same context splits, so a decode-heavy round reads each byte as the decode kernel
  does.
* **chunk rows** (two tokens or more): attention blocks of ``block`` tokens from the row's first
  token (:func:`chunk_blocks`); append blocks cut at page boundaries (:func:`page_blocks`), so
  every block's tokens lie in one logical page and no two programs of one call write one page (the
  Mosaic append rewrites whole pages).

Every function here is ``jax.numpy`` on the call's small int32 arrays (``O(R + N)`` work outside
the kernels); the block arrays become the kernels' scalar operands.  :func:`token_blocks` maps
each token back to its block and its offset in the block, and :func:`gather_tokens` gathers a
ragged attention's per-block outputs back to its tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .config import PagedAttentionConfig
from .tiles import next_pow2

__all__ = [
    "chunk_block_q",
    "Blocks",
    "decode_block_count",
    "chunk_block_count",
    "page_block_count",
    "decode_blocks",
    "chunk_blocks",
    "page_blocks",
    "TokenBlocks",
    "token_blocks",
    "gather_tokens",
]

_POS_HI = 1 << 30  # positions are clamped below this (far past any table) so block arithmetic cannot wrap


class Blocks(NamedTuple):
    """The blocks of one class of a ragged call: each ``int32 (nb,)``, ``nb`` a static bound."""

    rows: jax.Array  # the block's table row; -1 for an inert block
    positions: jax.Array  # the position of the block's first token
    kv_lens: jax.Array  # its row's kv_len (attention); 0 for an inert block
    starts: jax.Array  # the token index of the block's first token; 0 for an inert block
    counts: jax.Array  # tokens in the block, in [0, block]; 0 for an inert block


def decode_block_count(num_rows: int, num_tokens: int) -> int:
    """Grid bound of the decode class: one block per row of one token."""
    return max(1, min(num_rows, num_tokens))


def chunk_block_count(num_rows: int, num_tokens: int, block: int) -> int:
    """Grid bound of the chunk class: ``sum ceil(len / block)`` over rows of >= 2 tokens.

    With ``k <= min(R, N // 2)`` such rows of ``N`` tokens at most, the sum is at most
    ``(N + k * (block - 1)) // block``.
    """
    k = min(num_rows, num_tokens // 2)
    return max(1, min(num_tokens, (num_tokens + k * (block - 1)) // block))


def page_block_count(num_rows: int, num_tokens: int, page: int) -> int:
    """Grid bound of the append's chunk class: the logical pages the rows of >= 2 tokens touch.

    A row of ``len`` tokens starting anywhere in a page touches at most ``(len + page - 2) // page + 1``
    pages, so ``k`` such rows touch at most ``(N + k * (page - 2)) // page + k``.
    """
    k = min(num_rows, num_tokens // 2)
    return max(1, min(num_tokens, (num_tokens + k * (page - 2)) // page + k))


def chunk_block_q(config: PagedAttentionConfig, *, rows: int, num_tokens: int, group: int, head_dim: int,
                  kv_heads: int, max_keys: int) -> int:
    """The chunk rows' ``block_q`` of a backend whose programs take ``rows`` query rows by default.

    ``config.block_q`` when set; else as many tokens as fill ``rows`` query rows (``rows //
    next_pow2(G)``, at least 1, at most 128), and never more than the next power of two of ``N``
    (``PagedAttentionConfig.resolve``).  Each backend names its ``rows`` (``CHUNK_ROWS`` in its
    ``ragged`` module): the bigger the block, the fewer times a chunk's pages are read (each page
    once per block and KV head; ``bench/bench_ragged_traffic.py``).
    """
    if config.block_q is None:
        config = dataclasses.replace(config, block_q=min(128, max(1, rows // next_pow2(group))))
    return config.resolve(num_queries=num_tokens, group=group, head_dim=head_dim, batch=1, kv_heads=kv_heads,
                          max_keys=max_keys).block_q


def _spans(query_starts: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each row's first token and length (the effective starts of :mod:`ninfer_kv.ops.ragged`)."""
    s = jnp.clip(jnp.asarray(query_starts, jnp.int32), 0, num_tokens)
    e = jax.lax.cummax(s, axis=0)
    return e[:-1], e[1:] - e[:-1]


def _clamped_positions(positions: jax.Array, num_tokens: int) -> jax.Array:
    # A row starting below -(N + 64) has every token at a negative position either way; one
    # starting at or past 2**30 is past any table.  Clamping keeps ``position + N`` from wrapping.
    return jnp.clip(jnp.asarray(positions, jnp.int32), -(num_tokens + 64), _POS_HI)


def _blocks(per_row: jax.Array, nb: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For ``nb`` blocks numbered row after row (``per_row[r]`` blocks of row ``r``): each block's
    row, its index within the row, and whether it is real."""
    r = per_row.shape[0]
    ends = jnp.cumsum(per_row)
    i = jnp.arange(nb, dtype=jnp.int32)
    row = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    real = row < r
    row = jnp.clip(row, 0, r - 1)
    return row, i - (ends[row] - per_row[row]), real


def _inert(real: jax.Array, rows, positions, kv_lens, starts, counts) -> Blocks:
    zero = jnp.int32(0)
    return Blocks(
        jnp.where(real, rows, -1), jnp.where(real, positions, zero), jnp.where(real, kv_lens, zero),
        jnp.where(real, starts, zero), jnp.where(real, counts, zero),
    )


def decode_blocks(table_rows, positions, kv_lens, query_starts, num_tokens: int) -> Blocks:
    """The decode class: one block per row of exactly one token (``decode_block_count`` blocks)."""
    start, length = _spans(query_starts, num_tokens)
    nb = decode_block_count(start.shape[0], num_tokens)
    row, _, real = _blocks((length == 1).astype(jnp.int32), nb)
    pos = _clamped_positions(positions, num_tokens)
    return _inert(real, jnp.asarray(table_rows, jnp.int32)[row], pos[row], jnp.asarray(kv_lens, jnp.int32)[row],
                  start[row], jnp.ones_like(row))


def chunk_blocks(table_rows, positions, kv_lens, query_starts, num_tokens: int, block: int) -> Blocks:
    """The chunk class for attention: rows of >= 2 tokens in blocks of ``block`` tokens from their first."""
    start, length = _spans(query_starts, num_tokens)
    nb = chunk_block_count(start.shape[0], num_tokens, block)
    per_row = jnp.where(length >= 2, (length + (block - 1)) // block, 0)
    row, j, real = _blocks(per_row, nb)
    pos = _clamped_positions(positions, num_tokens)
    first = j * block
    return _inert(real, jnp.asarray(table_rows, jnp.int32)[row], pos[row] + first,
                  jnp.asarray(kv_lens, jnp.int32)[row], start[row] + first,
                  jnp.minimum(block, length[row] - first))


def page_blocks(table_rows, positions, query_starts, num_tokens: int, page: int) -> Blocks:
    """The chunk class for appends: rows of >= 2 tokens cut where their positions cross a page
    boundary, so a block's tokens lie in one logical page (``kv_lens`` are 0: appends have none)."""
    start, length = _spans(query_starts, num_tokens)
    nb = page_block_count(start.shape[0], num_tokens, page)
    pos = _clamped_positions(positions, num_tokens)
    first_page = jnp.floor_divide(pos, page)
    last_page = jnp.floor_divide(pos + length - 1, page)
    per_row = jnp.where(length >= 2, last_page - first_page + 1, 0)
    row, j, real = _blocks(per_row, nb)
    p0 = pos[row]
    lo = jnp.maximum(p0, (first_page[row] + j) * page)
    hi = jnp.minimum(p0 + length[row], (first_page[row] + j + 1) * page)
    return _inert(real, jnp.asarray(table_rows, jnp.int32)[row], lo, jnp.zeros_like(row), start[row] + (lo - p0),
                  hi - lo)


class TokenBlocks(NamedTuple):
    """Where each token's output lies among per-block outputs: each ``int32 (N,)``."""

    decode: jax.Array  # 1 where the token is a decode row's, else 0
    block: jax.Array  # its block in its class (0 for padding)
    offset: jax.Array  # its index within the block (0 for decodes and padding)
    real: jax.Array  # 1 for a token of a row, 0 for padding


def token_blocks(query_starts, num_tokens: int, block: int) -> TokenBlocks:
    """Each token's class, block and offset under :func:`decode_blocks` / :func:`chunk_blocks`."""
    start, length = _spans(query_starts, num_tokens)
    r = start.shape[0]
    i = jnp.arange(num_tokens, dtype=jnp.int32)
    ends = start + length
    row = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    safe = jnp.clip(row, 0, r - 1)
    real = (row < r) & (i >= start[safe])
    dec_rows = (length == 1).astype(jnp.int32)
    chunk_rows = jnp.where(length >= 2, (length + (block - 1)) // block, 0)
    local = i - start[safe]
    is_dec = real & (length[safe] == 1)
    dec_block = jnp.cumsum(dec_rows)[safe] - 1
    chunk_block = jnp.cumsum(chunk_rows)[safe] - chunk_rows[safe] + local // block
    blk = jnp.where(is_dec, dec_block, chunk_block)
    return TokenBlocks(is_dec.astype(jnp.int32), jnp.where(real, blk, 0), jnp.where(real & ~is_dec, local % block, 0),
                       real.astype(jnp.int32))


def gather_tokens(dec: jax.Array, chunk: jax.Array, where: TokenBlocks) -> jax.Array:
    """The ``(N, Hq, D)`` output of a ragged attention from its decode blocks ``(nb, 1, Hq, D)`` and
    chunk blocks ``(nb', block_q, Hq, D)``; padding tokens get zeros."""
    from_dec = dec[jnp.clip(where.block, 0, dec.shape[0] - 1), 0]
    from_chunk = chunk[jnp.clip(where.block, 0, chunk.shape[0] - 1), where.offset]
    out = jnp.where((where.decode == 1)[:, None, None], from_dec, from_chunk)
    return jnp.where((where.real == 1)[:, None, None], out, jnp.zeros((), out.dtype))
