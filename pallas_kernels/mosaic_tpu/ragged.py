"""Native ragged paged append and attention on Mosaic TPU: a static grid over a round's row blocks.

The arguments are those of the reference ragged ops (:func:`ninfer_kv.ops.paged_append_ragged`,
:func:`ninfer_kv.ops.paged_attention_ragged`) plus keyword-only ``config`` and ``interpret`` (as
the rectangular Mosaic ops take them).  A round is cut into blocks by
:mod:`pallas_kernels.common.ragged` (``jax.numpy`` on the ``(R,)`` and ``(R + 1,)`` int32 arrays);
the blocks' rows, positions, lengths and counts become the kernels' scalar-prefetch operands
(SMEM), so nothing is compiled per round and the grids depend only on the static ``(R, N)``:

* **attention**, two ``pallas_call`` s of the rectangular kernel
  (:func:`~pallas_kernels.mosaic_tpu.paged_attention.attention_blocks`) with its optional per-block
  ``counts`` operand: query ``i`` of a block is real iff ``i < count`` and the block's key frontier
  is ``min(kv_len, position + count)``.  The decode rows (one token each) run on a grid
  ``(min(R, N), H, 1)`` whose programs are the rectangular decode kernel's (query rows = the GQA
  group of one token); the chunk rows (two tokens or more) on a grid ``(nb, H, 1)`` of ``block_q``
  -token blocks (:data:`CHUNK_ROWS`: by default 256 query rows).
  A program DMAs each live page of its row (the pages below ``ceil(min(kv_len, position +
  count) / 64)``; with a sliding ``window``, from the first page its first query sees,
  ``max(0, position - window + 1) // 64``) once for all of its tokens and the whole GQA group,
  double-buffered; an inert block (``rows = -1``) fetches nothing.  A TPU ``BlockSpec`` block
  starts at a multiple of its extent, so a block of ``block_q`` tokens starting anywhere on the
  token axis cannot be addressed in place: the wrapper gathers the queries into the block layout
  ``(nb, H, block_q * G, D)`` (zeros past each block's count; one ``O(nb * block_q * Hq * D)``
  gather), and the per-block outputs are gathered back to the tokens
  (:func:`~pallas_kernels.common.ragged.gather_tokens`; padding tokens get exact zeros).
* **append**, two ``pallas_call`` s of the rectangular append kernel
  (:func:`~pallas_kernels.mosaic_tpu.paged_append.append_blocks`) over the same planes (aliased
  in place): the decode rows one token per block (``T = 1``), the chunk rows in blocks cut at
  page boundaries (:func:`~pallas_kernels.common.ragged.page_blocks`, ``T = min(64, N)``, one
  window each).  The blocks' tokens are gathered from the token axis (zeros past the count) and
  ``rows``/``positions``/``valid`` are the blocks' rows, positions and counts.  The append reads,
  merges and rewrites whole ``(64, X)`` pages; the page blocks of one call map distinct logical
  pages, so no two programs of a call rewrite one page, and the decode call finishes before the
  chunk call starts.

Out-of-range rules are the rectangular ops': a table row outside ``[0, C)`` is inert, a table
entry outside ``[0, N)`` hides its keys and drops its tokens, positions outside ``[0, L * 64)``
are dropped by the append and a query at a negative position sees no key; ``query_starts`` is
clamped into ``[0, N]`` and made non-decreasing (:mod:`ninfer_kv.ops.ragged`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_kv.ops.views import PagedKVBatchLayerView

from ..common import ragged
from ..common.config import PagedAppendConfig, PagedAttentionConfig
from .backend import prepare
from .paged_append import append_blocks
from .paged_attention import attention_blocks

__all__ = ["paged_append_ragged", "paged_attention_ragged", "append_class", "attention_class", "CHUNK_ROWS",
           "CLASSES"]

CLASSES = ("decode", "chunk")
"""The two classes of a round's rows, each one ``pallas_call`` per op: rows of one token, rows of two or more."""


def _block_tokens(x: jax.Array, blocks: ragged.Blocks, tokens: int) -> jax.Array:
    """The ``(nb, tokens, ...)`` rows of ``x (N, ...)`` of each block (token ``starts + i``), zeros past its count."""
    i = jnp.arange(tokens, dtype=jnp.int32)
    idx = jnp.clip(blocks.starts[:, None] + i[None, :], 0, x.shape[0] - 1)
    real = (i[None, :] < blocks.counts[:, None]).reshape(idx.shape + (1,) * (x.ndim - 1))
    return jnp.where(real, x[idx], jnp.zeros((), x.dtype))


CHUNK_ROWS = 256
"""Query rows of a chunk block by default (:func:`~pallas_kernels.common.ragged.chunk_block_q`).

The GPU kernels' tiles live in registers; a Mosaic program's tile lives in VMEM, so it takes 256
rows (64 tokens at GQA 4): each page is fetched once per 256 query rows, and 256 rows fill a v6e
MXU pass."""


def paged_attention_ragged(
    q: jax.Array,
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    query_starts: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    config: PagedAttentionConfig | None = None,
    interpret=None,
) -> jax.Array:
    """Attention of the ragged queries ``q (N, Hq, D)`` over each row's pages; ``(N, Hq, D)`` in ``q.dtype``.

    Args:
      q: float32 or bfloat16 queries, row ``r``'s tokens ``[query_starts[r], query_starts[r + 1])``.
      view: the pool's batch view.
      table_rows, positions, kv_lens: int32 ``(R,)``; query_starts: int32 ``(R + 1,)``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      window, soft_cap, sinks: the attention variant (``None``: unused), as
        :func:`~pallas_kernels.mosaic_tpu.paged_attention.paged_attention` takes them; with a
        ``window`` each block's page loop starts at the first page its first query sees.
      config: a :class:`PagedAttentionConfig`: ``block_q`` of the chunk rows' blocks (decode rows
        always take one token per block); its ``compiler`` a
        :class:`~pallas_kernels.mosaic_tpu.backend.MosaicConfig` or ``None``.
      interpret: ``None``: TPU interpret mode unless the default backend is a TPU; ``True``,
        ``False`` or a ``pltpu.InterpretParams``.
    Returns: ``(N, Hq, D)``; zeros for padding tokens and for queries with no visible key.
    """
    n = q.shape[0]
    if n == 0 or jnp.shape(table_rows)[0] == 0:
        prepare(config, PagedAttentionConfig, view, interpret)
        return jnp.zeros(q.shape, q.dtype)
    args = (q, view, table_rows, positions, kv_lens, query_starts)
    kw = dict(sm_scale=sm_scale, window=window, soft_cap=soft_cap, sinks=sinks, config=config, interpret=interpret)
    dec, chunk = (attention_class(cls, *args, **kw) for cls in CLASSES)
    return ragged.gather_tokens(dec, chunk, ragged.token_blocks(query_starts, n, chunk.shape[1]))


def attention_class(
    cls: str,
    q: jax.Array,
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    query_starts: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    config: PagedAttentionConfig | None = None,
    interpret=None,
) -> jax.Array:
    """The ``pallas_call`` of one class (``"decode"`` or ``"chunk"``) of :func:`paged_attention_ragged`.

    Arguments as :func:`paged_attention_ragged` (``N >= 1``, ``R >= 1``).  Returns the per-block
    outputs ``(nb, tokens, Hq, D)`` (``tokens`` 1 for the decode class, ``block_q`` for the chunk
    class), which :func:`~pallas_kernels.common.ragged.gather_tokens` maps back to the tokens.  One
    class alone is one Mosaic kernel (what the deviceless compile check measures).
    """
    config, compiler, interpret = prepare(config, PagedAttentionConfig, view, interpret)
    lay = view.layout
    n, hq_len, d = q.shape
    if cls == "decode":
        blocks, tokens = ragged.decode_blocks(table_rows, positions, kv_lens, query_starts, n), 1
    elif cls == "chunk":
        tokens = ragged.chunk_block_q(config, rows=CHUNK_ROWS, num_tokens=n, group=hq_len // lay.num_kv_heads,
                                      head_dim=d, kv_heads=lay.num_kv_heads,
                                      max_keys=view.logical_pages * lay.page_size)
        blocks = ragged.chunk_blocks(table_rows, positions, kv_lens, query_starts, n, tokens)
    else:
        raise ValueError(f"class {cls!r} is not one of {CLASSES}")
    # one query tile per block: its (tokens * G, D) block is the whole extent of the last two dims
    return attention_blocks(_block_tokens(q, blocks, tokens), view, blocks.rows, blocks.positions, blocks.kv_lens,
                            blocks.counts, block_q=tokens, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                            sinks=sinks, compiler=compiler, interpret=interpret,
                            name=f"mosaic_paged_attention_ragged_{cls}_{lay.profile.value}_{lay.order.value}_d{d}")


def paged_append_ragged(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_starts: jax.Array,
    *,
    config: PagedAppendConfig | None = None,
    interpret=None,
) -> PagedKVBatchLayerView:
    """Quantize the ragged ``k, v (N, H, D)`` per the view's profile and append each row's tokens in place.

    Args:
      view: the pool's batch view.
      table_rows, positions: int32 ``(R,)``; query_starts: int32 ``(R + 1,)``.
      k, v: ``(N, H, D)`` float32 or bfloat16.
      config: a :class:`PagedAppendConfig` (its ``compiler`` a
        :class:`~pallas_kernels.mosaic_tpu.backend.MosaicConfig` or ``None``; ``block_t`` is not
        used: a program encodes all tokens of its block and head).
      interpret: as :func:`paged_attention_ragged`.
    Returns: the view with the updated planes (the same buffers when the caller donated them).
    """
    if k.shape[0] == 0 or jnp.shape(table_rows)[0] == 0:
        prepare(config, PagedAppendConfig, view, interpret)
        return view
    for cls in CLASSES:  # the decode call, then the chunk call, over the same (aliased) planes
        view = append_class(cls, view, table_rows, positions, k, v, query_starts, config=config, interpret=interpret)
    return view


def append_class(
    cls: str,
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_starts: jax.Array,
    *,
    config: PagedAppendConfig | None = None,
    interpret=None,
) -> PagedKVBatchLayerView:
    """The ``pallas_call`` of one class (``"decode"`` or ``"chunk"``) of :func:`paged_append_ragged`:
    the rows of that class appended, the others untouched.  Arguments as :func:`paged_append_ragged`
    (``N >= 1``, ``R >= 1``); one Mosaic kernel."""
    config, compiler, interpret = prepare(config, PagedAppendConfig, view, interpret)
    lay = view.layout
    n, page = k.shape[0], lay.page_size
    if cls == "decode":
        zeros = jnp.zeros((jnp.shape(table_rows)[0],), jnp.int32)
        blocks, tokens = ragged.decode_blocks(table_rows, positions, zeros, query_starts, n), 1
    elif cls == "chunk":  # page blocks: a block's tokens lie in one logical page
        blocks, tokens = ragged.page_blocks(table_rows, positions, query_starts, n, page), min(page, n)
    else:
        raise ValueError(f"class {cls!r} is not one of {CLASSES}")
    return append_blocks(
        view, blocks.rows, blocks.positions, _block_tokens(k, blocks, tokens), _block_tokens(v, blocks, tokens),
        blocks.counts, compiler=compiler, interpret=interpret, one_page=cls == "chunk",
        name=f"mosaic_paged_append_ragged_{cls}_{lay.profile.value}_{lay.order.value}_d{lay.head_dim}",
    )
