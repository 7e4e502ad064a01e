"""pallas_kernels.common.ragged: the blocks of a ragged call cover every real token once, within the grid bound.

Random rounds (row lengths with empty rows, decodes and chunks, padding before and after, starts that
decrease or overshoot as under ``jit``, positions anywhere including negative and far past a table)
are cut into the decode, chunk and page classes; every token of a row lies in exactly one real block
of its class at its own position, no block crosses its size (or, for page blocks, a page boundary),
the real blocks fit the static grid bound, inert blocks are inert, and :func:`token_blocks` finds
each token where the blocks put it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.ops.ragged import token_rows
from pallas_kernels.common import ragged

PAGE = 64


_ROWS, _TOKENS = 6, 800  # every round is padded to these static shapes: one compile per block size


@st.composite
def rounds(draw):
    lengths = draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 5, 63, 64, 65, 130]), min_size=1, max_size=_ROWS))
    lengths += [0] * (_ROWS - len(lengths))  # trailing empty rows
    lead = draw(st.integers(0, 3))
    starts = lead + np.concatenate([[0], np.cumsum(lengths)])
    if draw(st.booleans()):  # under jit: a start that decreases or overshoots is clamped
        i = draw(st.integers(0, len(starts) - 1))
        starts[i] = draw(st.sampled_from([-5, 0, int(starts[-1]) + 7, _TOKENS + 9]))
    positions = draw(st.lists(st.sampled_from([0, 1, 62, 63, 64, 100, 4095, -3, -200, 2**30 + 5, 2**31 - 1]),
                              min_size=_ROWS, max_size=_ROWS))
    block = draw(st.sampled_from([1, 4, 16]))
    return np.asarray(starts, np.int32), _TOKENS, np.asarray(positions, np.int32), block


_decode = jax.jit(ragged.decode_blocks, static_argnums=4)
_chunk = jax.jit(ragged.chunk_blocks, static_argnums=(4, 5))
_pages = jax.jit(ragged.page_blocks, static_argnums=(3, 4))
_where = jax.jit(ragged.token_blocks, static_argnums=(1, 2))


def _np(blocks: ragged.Blocks) -> dict:
    return {k: np.asarray(v) for k, v in blocks._asdict().items()}


def _expected(starts, n, positions):
    """Per token: its row (R for padding) and position, from the generic form's token rows."""
    r = len(positions)
    tok = token_rows(jnp.arange(r, dtype=jnp.int32), jnp.asarray(positions), jnp.asarray(starts), n)
    return np.asarray(tok.row), np.asarray(tok.positions), np.asarray(tok.real) == 1


def _check_cover(b: dict, rows_of_token, pos_of_token, real, want_len, size, nb_bound, *, page_cut=False):
    """Every real token whose row length satisfies ``want_len`` lies in exactly one real block."""
    nb = b["rows"].shape[0]
    assert nb == nb_bound
    seen = np.zeros(rows_of_token.shape[0], np.int32)
    for i in range(nb):
        c = int(b["counts"][i])
        if b["rows"][i] < 0:
            assert c == 0 and b["kv_lens"][i] == 0, "an inert block must hold nothing"
            continue
        assert 1 <= c <= size, (i, c, size)
        s = int(b["starts"][i])
        toks = np.arange(s, s + c)
        assert real[toks].all()
        assert (rows_of_token[toks] == rows_of_token[s]).all(), "a block is one row's"
        assert b["rows"][i] == rows_of_token[s]  # table row r is row r in these rounds
        # the block's first position, then consecutive positions
        assert (pos_of_token[toks] == np.int64(b["positions"][i]) + np.arange(c)).all()
        if page_cut:
            p = np.int64(b["positions"][i]) + np.arange(c)
            assert len(set((p // PAGE).tolist())) == 1, "a page block crosses a page boundary"
        seen[toks] += 1
    length = np.bincount(rows_of_token[real], minlength=int(rows_of_token.max(initial=0)) + 1)
    want = real & np.array([want_len(length[r]) if ok else False for r, ok in zip(rows_of_token, real)], bool)
    assert (seen == want.astype(np.int32)).all(), (seen, want)


@settings(max_examples=40, deadline=None)
@given(rounds())
def test_blocks_cover_each_token_once_within_the_bound(case):
    starts, n, positions = case[:3]
    block = case[3]
    r = len(positions)
    table_rows = np.arange(r, dtype=np.int32)
    kv_lens = np.full(r, 77, np.int32)
    # Positions far outside any table are clamped (every token of such a row stays out of range);
    # each token's position is its row's clamped position plus its index in the row.
    clamped = np.clip(positions.astype(np.int64), -(n + PAGE), 1 << 30).astype(np.int32)
    row_of, pos_ref, real = _expected(starts, n, clamped)

    dec = _np(_decode(table_rows, positions, kv_lens, starts, n))
    _check_cover(dec, row_of, pos_ref, real, lambda ln: ln == 1, 1, ragged.decode_block_count(r, n))
    assert (dec["kv_lens"][dec["rows"] >= 0] == 77).all()

    chunk = _np(_chunk(table_rows, positions, kv_lens, starts, n, block))
    _check_cover(chunk, row_of, pos_ref, real, lambda ln: ln >= 2, block, ragged.chunk_block_count(r, n, block))

    pages = _np(_pages(table_rows, positions, starts, n, PAGE))
    _check_cover(pages, row_of, pos_ref, real, lambda ln: ln >= 2, PAGE, ragged.page_block_count(r, n, PAGE),
                 page_cut=True)

    where = {k: np.asarray(v) for k, v in _where(starts, n, block)._asdict().items()}
    assert ((where["real"] == 1) == real).all()
    for t in np.flatnonzero(real):
        blocks = dec if where["decode"][t] else chunk
        i, off = where["block"][t], where["offset"][t]
        assert blocks["rows"][i] >= 0 and blocks["starts"][i] + off == t, (t, i, off)


def test_gather_tokens_places_each_blocks_rows_and_zeros_padding():
    # rows: a chunk of 5 (blocks of 4: 4 + 1), a decode, an empty row, a decode; one padding token each side
    starts = jnp.asarray([1, 6, 7, 7, 8], jnp.int32)
    n = 9
    where = ragged.token_blocks(starts, n, 4)
    dec = jnp.arange(4 * 1 * 2 * 3, dtype=jnp.float32).reshape(4, 1, 2, 3) + 1000
    chunk = jnp.arange(5 * 4 * 2 * 3, dtype=jnp.float32).reshape(5, 4, 2, 3) + 1
    out = np.asarray(ragged.gather_tokens(dec, chunk, where))
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_array_equal(out[8], 0)
    np.testing.assert_array_equal(out[1:5], np.asarray(chunk[0]))
    np.testing.assert_array_equal(out[5], np.asarray(chunk[1, 0]))
    np.testing.assert_array_equal(out[6], np.asarray(dec[0, 0]))
    np.testing.assert_array_equal(out[7], np.asarray(dec[1, 0]))


def test_the_bounds_are_tight_enough_and_never_exceeded():
    """The worst cases the bounds are derived from: every row of two tokens straddling a page."""
    r, n = 8, 16
    starts = jnp.arange(0, 18, 2, dtype=jnp.int32)
    positions = jnp.full((r,), 63, jnp.int32)  # each row's 2 tokens cross a page boundary
    pages = ragged.page_blocks(jnp.arange(r, dtype=jnp.int32), positions, starts, n, PAGE)
    assert int((np.asarray(pages.counts) > 0).sum()) == 16 == ragged.page_block_count(r, n, PAGE)
    chunk = ragged.chunk_blocks(jnp.arange(r, dtype=jnp.int32), positions, jnp.zeros(r, jnp.int32), starts, n, 16)
    assert int((np.asarray(chunk.counts) > 0).sum()) == 8 == ragged.chunk_block_count(r, n, 16)
    assert jax.jit(lambda s: ragged.decode_blocks(jnp.arange(r), jnp.zeros(r), jnp.zeros(r), s, n).counts)(
        starts).shape == (ragged.decode_block_count(r, n),)
