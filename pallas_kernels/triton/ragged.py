"""Native ragged paged append and attention on Triton: a static grid over a round's row blocks.

The arguments are those of the reference ragged ops (:func:`ninfer_kv.ops.paged_append_ragged`,
:func:`ninfer_kv.ops.paged_attention_ragged`) plus keyword-only ``config`` and ``interpret``.  A
round is cut into blocks by :mod:`pallas_kernels.common.ragged` (``jax.numpy`` on the ``(R,)`` and
``(R + 1,)`` int32 arrays; the blocks' rows, positions, lengths, first tokens and counts become
the kernels' scalar operands, so nothing is compiled per round):

* **attention**, two ``pallas_call`` s: the decode rows (one token each) on a grid ``(min(R, N), H,
  1, k_splits)`` whose programs are the rectangular decode kernel's (tile rows = the GQA group of
  one token, the same context splits), and the chunk rows (two tokens or more) on a grid ``(nb, H,
  1, k_splits)`` of ``block_q``-token blocks (:func:`chunk_rows`: 128 query rows by default for
  head dims up to 128, twice the rectangular chunk kernel's).  Each program is
  :func:`~pallas_kernels.triton.attention.attention_program` reading its queries straight from the
  ``(N, Hq, D)`` token axis and each live page of its row once (the pages below its last query's
  frontier, and with a ``window`` from the page holding the first key its first token sees) for all
  of its tokens and the whole GQA group.  Outputs are per block and gathered back
  to tokens (an ``(N, Hq, D)`` gather); padding tokens get exact zeros.
* **append**, two ``pallas_call`` s over the same planes (aliased in place): decode rows one token
  per block, chunk rows in blocks cut at page boundaries, each quantized and stored by
  :func:`~pallas_kernels.triton.append.quantize_and_store` reading its tokens from the token axis.

The append is a separate call, not fused into the attention: a round's appends move ``N`` tokens
once, while its attention reads every live page once per query block.  The traffic bench
(``bench/bench_ragged_traffic.py``, bf16, Llama-3-8B-like) puts the append at 0.05 % of the bytes of
64 decodes at 2K and 0.7-2.1 % of a round with a 1024-token chunk, so fusing could save at most
that much; it would also make a program read pages that other programs of the same call are
writing (a chunk's later query blocks read the keys its earlier tokens append), which needs an
order between programs that a parallel grid does not give.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ninfer_kv.ops.views import PagedKVBatchLayerView

from ..common import ragged
from ..common.config import PagedAppendConfig, PagedAttentionConfig
from ..common.softmax import compute_dtype_for
from .append import append_call
from .attention import AttentionSpec, attention_call, resolution_keys, variant_suffix
from .backend import TRITON, prepare
from .config import query_rows
from .paged_append import paged_addresser
from .paged_attention import paged_key_source, variant_options

__all__ = ["paged_append_ragged", "paged_attention_ragged", "chunk_rows"]


def chunk_rows(head_dim: int) -> int:
    """Query rows of a chunk block by default (:func:`~pallas_kernels.common.ragged.chunk_block_q`):
    128 for head dims up to 128 (32 tokens at GQA 4; 8 warps, no spill at sm_90a in
    ``bench/deviceless_gpu.py``), 64 above (a 128-row tile of D 256 spills hundreds of bytes).
    Each page is read once per block, so 128 rows read a chunk's pages half as often as the
    rectangular kernel's 64."""
    return 128 if head_dim <= 128 else 64


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
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of the ragged queries ``q (N, Hq, D)`` over each row's pages; ``(N, Hq, D)`` in ``q.dtype``.

    ``config`` (a :class:`PagedAttentionConfig`) sets the chunk rows' ``block_q`` and both classes'
    ``block_k``, ``k_splits`` and Triton knobs; decode rows always take one token per block.
    ``window``, ``soft_cap`` and ``sinks`` are :func:`~pallas_kernels.triton.paged_attention.paged_attention`'s.
    """
    options = variant_options(q.shape[1], window, soft_cap, sinks)
    window, soft_cap, sinks = (options.get(k) for k in ("window", "soft_cap", "sinks"))
    config, knobs, interpret = prepare(config, PagedAttentionConfig, view, interpret)
    lay = view.layout
    n, hq_len, d = q.shape
    r = jnp.shape(table_rows)[0]
    if n == 0 or r == 0:
        return jnp.zeros(q.shape, q.dtype)
    h_len = lay.num_kv_heads
    group = hq_len // h_len
    max_keys = view.logical_pages * lay.page_size
    sm_scale = (1.0 / d**0.5) if sm_scale is None else float(sm_scale)
    options_spec = {**({} if window is None else {"window": window}),
                    **({} if soft_cap is None else {"soft_cap": soft_cap}), **({} if sinks is None else {"sinks": True})}

    def run(blocks: ragged.Blocks, num_queries: int, batch: int, cls: str, block_q: int) -> jax.Array:
        cfg = dataclasses.replace(config, block_q=block_q).resolve(
            num_queries=num_queries, group=group, head_dim=d, batch=batch, kv_heads=h_len,
            max_keys=resolution_keys(max_keys, window, num_queries))
        compiler = knobs.for_attention(d, query_rows(cfg.block_q, group))
        spec = AttentionSpec(profile=lay.profile, head_dim=d, num_queries=num_queries, group=group, cfg=cfg,
                             compiler=compiler, sm_scale=sm_scale, compute_dtype=compute_dtype_for(q.dtype),
                             **options_spec)
        return attention_call(
            TRITON, q=q, view=view, names=list(lay.plane_names), rows=blocks.rows, positions=blocks.positions,
            kv_lens=blocks.kv_lens, tables=(view.block_tables,), spec=spec, interpret=interpret,
            name=(f"paged_attention_ragged_{cls}_{lay.profile.value}_{lay.order.value}_d{d}_q{cfg.block_q}"
                  f"_k{cfg.block_k}_s{cfg.k_splits}{variant_suffix(window, soft_cap, sinks)}"),
            make_key_source=paged_key_source(TRITON, view, cfg.block_k), row_limit=view.block_tables.shape[0],
            key_limit=max_keys, starts=blocks.starts, counts=blocks.counts, sinks=sinks,
        )

    nb_dec = ragged.decode_block_count(r, n)
    dec = run(ragged.decode_blocks(table_rows, positions, kv_lens, query_starts, n), 1, nb_dec, "decode", 1)
    block_q = ragged.chunk_block_q(config, rows=chunk_rows(d), num_tokens=n, group=group, head_dim=d,
                                   kv_heads=h_len, max_keys=max_keys)
    chunk = run(ragged.chunk_blocks(table_rows, positions, kv_lens, query_starts, n, block_q), n, 1, "chunk", block_q)
    return ragged.gather_tokens(dec, chunk, ragged.token_blocks(query_starts, n, block_q))


def paged_append_ragged(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_starts: jax.Array,
    *,
    config: PagedAppendConfig | None = None,
    interpret: bool | None = None,
) -> PagedKVBatchLayerView:
    """Quantize the ragged ``k, v (N, H, D)`` per the view's profile and append each row's tokens in place.

    ``config`` (a :class:`PagedAppendConfig`) sets ``block_t`` of the chunk rows' page blocks and the
    Triton knobs.
    """
    config, compiler, interpret = prepare(config, PagedAppendConfig, view, interpret)
    compiler = compiler.for_append()
    lay = view.layout
    n = k.shape[0]
    r = jnp.shape(table_rows)[0]
    if n == 0 or r == 0:
        return view
    page = lay.page_size
    zeros = jnp.zeros((r,), jnp.int32)
    classes = (
        ("decode", ragged.decode_blocks(table_rows, positions, zeros, query_starts, n), 1),
        ("chunk", ragged.page_blocks(table_rows, positions, query_starts, n, page), page),
    )
    for cls, blocks, tokens in classes:
        planes = append_call(
            TRITON, view=view, names=list(lay.plane_names), rows=blocks.rows, positions=blocks.positions,
            valid=blocks.counts, tables=(view.block_tables,), k=k, v=v, cfg=config.for_tokens(tokens),
            compiler=compiler, interpret=interpret,
            name=f"paged_append_ragged_{cls}_{lay.profile.value}_{lay.order.value}_d{lay.head_dim}",
            make_address=paged_addresser(TRITON, view, interpret), row_limit=view.block_tables.shape[0],
            ragged=(blocks.starts, tokens),
        )
        view = view.replace(planes=planes)
    return view
