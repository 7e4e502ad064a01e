"""Paged attention over the stacked planes: decode (T = 1) and chunks (prefill, speculative verify).

Query ``t`` of row ``b`` sits at ``positions[b] + t``; key ``j`` is visible iff
``j <= positions[b] + t`` and ``j < kv_lens[b]`` (and ``j > positions[b] + t - window`` with a
sliding ``window``).  Query head ``hq`` reads KV head ``hq // (Hq / H)``; a query with no visible
key returns zeros.  ``soft_cap`` caps the scores (``soft_cap * tanh(s / soft_cap)``) and ``sinks``
adds one zero-value logit per query head to the softmax's denominator.

Grid: ``(B, H, ceil(T / block_q), k_splits)``.  Each program reads the row's table entry
``block_tables[table_rows[b], blk]`` for each logical block it visits (a load inside the kernel),
then the page's tiles straight from the stacked planes (layer index, page index and head index
are dynamic offsets into the whole plane); nothing is gathered into a contiguous buffer and
nothing proportional to the context is staged.  A program stops at the last block that holds a
visible key, so table entries past a row's ``kv_len`` are never read (they may be poison), and
physical page IDs may come in any order.  With a ``window`` it also starts at the block holding
the first key its first query sees: blocks wholly before the window (table entries and pages)
are not read, so a row reads about ``window / 64 + 1`` pages.

Out-of-range inputs under ``jit`` (SEMANTICS of :mod:`ninfer_kv.ops`): a ``table_rows[b]`` outside
``[0, C)`` returns zeros for row ``b``; a block whose table entry is outside ``[0, N)`` is
invisible (its keys are masked like keys past ``kv_len``, and page 0 is addressed instead);
``kv_lens`` is clipped to ``[0, L * 64]``; a query at a negative position sees no key.

See :mod:`pallas_kernels.triton.attention` for the per-program arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.ops.validation import check_attention_variant
from ninfer_kv.ops.views import PagedKVBatchLayerView

from ..common.config import PagedAttentionConfig
from ..common.softmax import compute_dtype_for
from .attention import AttentionSpec, attention_call, masked_tile_load, run_attention, variant_suffix
from .backend import TritonBackend

__all__ = ["paged_attention", "paged_key_source", "variant_options"]


def paged_attention(
    q: jax.Array,
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    config: PagedAttentionConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of ``q (B, T, Hq, D)`` over each row's pages; returns ``(B, T, Hq, D)`` in ``q.dtype``.

    Args:
      q: queries, float32 or bfloat16 (bfloat16 queries use bfloat16 tensor-core products).
      view: the pool's batch view.
      table_rows, positions, kv_lens: int32 ``(B,)``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      window: ``None`` or a static int >= 1: query ``p`` sees only keys ``j > p - window``.
      soft_cap: ``None`` or a static float > 0: scores become ``soft_cap * tanh(s / soft_cap)``.
      sinks: ``None`` or float ``(Hq,)`` (may be traced): per-query-head sink logits.
      config: block sizes and Triton knobs (default :class:`PagedAttentionConfig`, resolved from the shapes).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    """
    options = variant_options(q.shape[2], window, soft_cap, sinks)
    return run_attention(
        "paged_attention", PagedAttentionConfig, _paged_attention_kernel, q, view, table_rows, positions, kv_lens,
        max_keys=view.logical_pages * view.layout.page_size, sm_scale=sm_scale, config=config, interpret=interpret,
        **options,
    )


def variant_options(q_heads: int, window, soft_cap, sinks) -> dict:
    """The given variant options, checked (``window`` an int >= 1, ``soft_cap`` a float > 0, ``sinks``
    float ``(Hq,)`` as float32); ``{}`` when all are ``None``, so the plain kernel is traced as before."""
    if window is None and soft_cap is None and sinks is None:
        return {}
    window, soft_cap, sinks = check_attention_variant(q_heads, window, soft_cap, sinks)
    return {"window": window, "soft_cap": soft_cap, "sinks": sinks}


def _paged_attention_kernel(backend: TritonBackend, q, view, table_rows, positions, kv_lens, *, sm_scale, cfg,
                            compiler, interpret, window=None, soft_cap=None, sinks=None):
    lay = view.layout
    order, page = lay.order, lay.page_size
    bsz, t_len, hq_len, d = q.shape
    if bsz == 0 or t_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    spec = AttentionSpec(
        profile=lay.profile, head_dim=d, num_queries=t_len, group=hq_len // lay.num_kv_heads, cfg=cfg,
        compiler=compiler, sm_scale=sm_scale, compute_dtype=compute_dtype_for(q.dtype),
        **({} if window is None else {"window": window}), **({} if soft_cap is None else {"soft_cap": soft_cap}),
        **({} if sinks is None else {"sinks": True}),
    )
    return attention_call(
        backend, q=q, view=view, names=list(lay.plane_names), rows=table_rows, positions=positions,
        kv_lens=kv_lens, tables=(view.block_tables,), spec=spec, interpret=interpret,
        name=(f"paged_attention_{lay.profile.value}_{order.value}_d{d}_q{cfg.block_q}_k{cfg.block_k}_s{cfg.k_splits}"
              + variant_suffix(window, soft_cap, sinks)),
        make_key_source=paged_key_source(backend, view, cfg.block_k), row_limit=view.block_tables.shape[0],
        key_limit=view.logical_pages * page, sinks=sinks,
    )


def paged_key_source(backend: TritonBackend, view: PagedKVBatchLayerView, bk: int):
    """The key-source factory of paged attention (:func:`~pallas_kernels.triton.attention.attention_call`):
    steps of ``bk`` keys through the block table, entries outside ``[0, N)`` hiding their keys."""
    lay = view.layout
    order, page = lay.order, lay.page_size
    shift = page.bit_length() - 1
    n_pages = view.num_pages

    def make_key_source(layer, row, h, plane_refs, bt_ref):
        def key_source(step, j, key_ok):
            tok = j & jnp.int32(page - 1)
            if bk == page:
                pg = backend.load_scalar(bt_ref, (row, step))  # one page per step (step < L: kv_len <= L * 64)
            else:
                blk = jax.lax.shift_right_arithmetic(j, jnp.int32(shift))
                pg = backend.load(bt_ref.at[row, jnp.where(key_ok, blk, 0)], mask=key_ok, other=0)
            # A table entry that is not a page of the pool hides its block's keys; address page 0.
            pg_ok = (pg >= 0) & (pg < n_pages)
            key_ok = key_ok & pg_ok
            pg = jnp.where(pg_ok, pg, 0)
            pg_tile = pg if bk == page else pg[:, None]

            def load(name, cols):
                if isinstance(cols, int):
                    pp, tt, cc = pg, tok, jnp.int32(cols)
                else:
                    pp, tt, cc = pg_tile, tok[:, None], cols.index()
                idx = (layer, pp, h, tt, cc) if order is PlaneOrder.PAGE_MAJOR else (layer, h, pp, tt, cc)
                return masked_tile_load(backend, plane_refs[name].at[idx], key_ok, cols)

            return load, key_ok

        return key_source

    return make_key_source
