"""Paged attention over the stacked planes: decode (T = 1) and chunks (prefill, speculative verify).

Query ``t`` of row ``b`` sits at ``positions[b] + t``; key ``j`` is visible iff
``j <= positions[b] + t`` and ``j < kv_lens[b]``.  Query head ``hq`` reads KV head
``hq // (Hq / H)``; a query with no visible key returns zeros.

Grid: ``(B, H, ceil(T / block_q), k_splits)``.  Each program reads the row's table entry
``block_tables[table_rows[b], blk]`` for each logical block it visits (a load inside the kernel),
then the page's tiles straight from the stacked planes (layer index, page index and head index
are dynamic offsets into the whole plane); nothing is gathered into a contiguous buffer and
nothing proportional to the context is staged.  A program stops at the last block that holds a
visible key, so table entries past a row's ``kv_len`` are never read (they may be poison), and
physical page IDs may come in any order.

See :mod:`pallas_kernels.attention_core` for the per-program arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ninfer_kv.geometry import PlaneOrder
from ninfer_kv.views import PagedKVBatchLayerView

from .attention_core import AttentionSpec, attention_program, combine_splits, compute_dtype_for, masked_tile_load
from .backends import TRITON, implementation, register, resolve_interpret
from .config import PagedAttentionConfig
from .limits import check_head_dim

__all__ = ["paged_attention"]


def paged_attention(
    q: jax.Array,
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    config: PagedAttentionConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of ``q (B, T, Hq, D)`` over each row's pages; returns ``(B, T, Hq, D)`` in ``q.dtype``.

    Args:
      q: queries, float32 or bfloat16 (bfloat16 queries use bfloat16 tensor-core products).
      view: the pool's batch view.
      table_rows, positions, kv_lens: int32 ``(B,)``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      config: block sizes (default :class:`PagedAttentionConfig`, resolved from the shapes).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    """
    config = PagedAttentionConfig() if config is None else config
    if not isinstance(config, PagedAttentionConfig):
        raise TypeError(f"config must be a PagedAttentionConfig, got {type(config).__name__}")
    lay = view.layout
    check_head_dim(lay.profile, lay.head_dim)
    b, t, hq, d = q.shape
    cfg = config.resolve(
        num_queries=t, group=hq // lay.num_kv_heads, head_dim=d, batch=b, kv_heads=lay.num_kv_heads,
        max_keys=view.logical_pages * lay.page_size,
    )
    sm_scale = (1.0 / d**0.5) if sm_scale is None else float(sm_scale)
    impl = implementation("paged_attention", cfg.backend)
    return impl(q, view, table_rows, positions, kv_lens, sm_scale=sm_scale, cfg=cfg,
                interpret=resolve_interpret(interpret))


@register("paged_attention", "triton")
def _paged_attention_triton(q, view, table_rows, positions, kv_lens, *, sm_scale, cfg, interpret):
    lay = view.layout
    order, page = lay.order, lay.page_size
    shift = page.bit_length() - 1
    bsz, t_len, hq_len, d = q.shape
    if bsz == 0 or t_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    h_len = lay.num_kv_heads
    names = list(lay.plane_names)
    spec = AttentionSpec(
        profile=lay.profile, head_dim=d, num_queries=t_len, group=hq_len // h_len, cfg=cfg,
        sm_scale=sm_scale, compute_dtype=compute_dtype_for(q.dtype),
    )
    bk = cfg.block_k
    splits = cfg.k_splits

    def kernel(layer_ref, rows_ref, pos_ref, lens_ref, bt_ref, q_ref, *refs):
        plane_refs = dict(zip(names, refs[: len(names)]))
        out_refs = refs[len(names):]
        b, h, qt, sp = (pl.program_id(i) for i in range(4))
        layer = layer_ref[0]
        row = rows_ref[b]

        def key_source(step, j, key_ok):
            tok = j & jnp.int32(page - 1)
            if bk == page:
                pg = bt_ref[row, step]  # one page per step: a scalar table load
                pg_tile = pg
            else:
                blk = jax.lax.shift_right_arithmetic(j, jnp.int32(shift))
                pg = pl_triton.load(bt_ref.at[row, jnp.where(key_ok, blk, 0)], mask=key_ok, other=0)
                pg_tile = pg[:, None]

            def load(name, cols):
                if isinstance(cols, int):
                    pp, tt, cc = pg, tok, jnp.int32(cols)
                else:
                    pp, tt, cc = pg_tile, tok[:, None], cols.index()
                idx = (layer, pp, h, tt, cc) if order is PlaneOrder.PAGE_MAJOR else (layer, h, pp, tt, cc)
                return masked_tile_load(plane_refs[name].at[idx], key_ok, cols)

            return load

        attention_program(
            spec, b=b, h=h, qt=qt, sp=sp, pos=pos_ref[b], kv_len=lens_ref[b], q_ref=q_ref,
            key_source=key_source, out_refs=out_refs,
        )

    q_tiles = -(-t_len // cfg.block_q)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, *q.shape[:-1]), jnp.float32),
            jax.ShapeDtypeStruct((splits, *q.shape[:-1]), jnp.float32),
        ]
    call = TRITON.pallas_call(
        kernel,
        grid=(bsz, h_len, q_tiles, splits),
        out_shape=out_shape,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"paged_attention_{lay.profile.value}_{order.value}_d{d}_q{cfg.block_q}_k{bk}_s{splits}",
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(table_rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(kv_lens, jnp.int32),
        view.block_tables,
        q,
        *[view.planes[n] for n in names],
    )
    if splits == 1:
        return out[0]
    return combine_splits(*out, dtype=q.dtype)
