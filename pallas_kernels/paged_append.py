"""Paged append: quantize K/V in the kernel and write them in place into the stacked planes.

Row ``b`` writes tokens ``t < valid[b]`` at logical positions ``p = positions[b] + t`` into page
``block_tables[table_rows[b], p >> 6]``, column ``p & 63``, of layer ``layer`` (page-major planes
``(num_layers, N, H, 64, X)`` or head-major ``(num_layers, H, N, 64, X)``).  Positions whose block is
past the table width are dropped, like the reference.  The table lookup happens inside the kernel;
only entries of blocks that are actually written are read.

The planes are passed whole and aliased input -> output (``input_output_aliases``), so under a
``jax.jit`` that donates them the append writes into the caller's buffers and copies nothing.

Grid: ``(B, ceil(T / block_t), H)``; each program quantizes ``block_t`` tokens of one (row, head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ninfer_kv.geometry import PlaneOrder
from ninfer_kv.views import PagedKVBatchLayerView

from .append_core import logical_planes, quantize_and_store, storage_planes
from .backends import TRITON, implementation, register, resolve_interpret
from .config import PagedAppendConfig
from .limits import check_head_dim

__all__ = ["paged_append"]


def paged_append(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    *,
    config: PagedAppendConfig | None = None,
    interpret: bool | None = None,
) -> PagedKVBatchLayerView:
    """Quantize ``k, v (B, T, H, D)`` per the view's profile and append them in place.

    Args:
      view: the pool's batch view (stacked planes, block tables ``int32 (C, L)``, layer).
      table_rows, positions, valid: int32 ``(B,)``.
      k, v: ``(B, T, H, D)`` float32 or bfloat16.
      config: block sizes (default :class:`PagedAppendConfig`).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    Returns: the view with the updated planes (the same buffers when the caller donated them).
    """
    config = PagedAppendConfig() if config is None else config
    if not isinstance(config, PagedAppendConfig):
        raise TypeError(f"config must be a PagedAppendConfig, got {type(config).__name__}")
    check_head_dim(view.layout.profile, view.layout.head_dim)
    impl = implementation("paged_append", config.backend)
    planes = impl(view, table_rows, positions, k, v, valid, config=config, interpret=resolve_interpret(interpret))
    return view.replace(planes=planes)


@register("paged_append", "triton")
def _paged_append_triton(view, table_rows, positions, k, v, valid, *, config, interpret) -> dict:
    lay = view.layout
    profile, order, d = lay.profile, lay.order, lay.head_dim
    bsz, t_len, h_len, _ = k.shape
    if bsz == 0 or t_len == 0:
        return dict(view.planes)
    n_pages = view.num_pages
    n_blocks = view.logical_pages
    page = lay.page_size
    shift = page.bit_length() - 1
    cfg = config.for_tokens(t_len)
    names = list(lay.plane_names)
    dtypes = [view.planes[n].dtype for n in names]
    planes = storage_planes([view.planes[n] for n in names], interpret)

    def kernel(layer_ref, rows_ref, pos_ref, valid_ref, bt_ref, k_ref, v_ref, *refs):
        out_refs = dict(zip(names, refs[len(names):]))
        b, tile, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        layer = layer_ref[0]
        row = rows_ref[b]
        pos = pos_ref[b]
        n_valid = valid_ref[b]

        def address(t):
            p = pos + t
            blk = jax.lax.shift_right_arithmetic(p, jnp.int32(shift))
            off = p & jnp.int32(page - 1)
            write = (t < n_valid) & (p >= 0) & (blk < n_blocks)
            pg = pl_triton.load(bt_ref.at[row, jnp.where(write, blk, 0)], mask=write, other=0)
            pg = jnp.where(write, pg, n_pages)  # out of range: never stored

            def index(cols):
                if cols.ndim == 0:
                    pp, oo = pg, off
                else:
                    pp, oo = pg[:, None], off[:, None]
                if order is PlaneOrder.PAGE_MAJOR:
                    return (layer, pp, h, oo, cols)
                return (layer, h, pp, oo, cols)

            return write, index

        quantize_and_store(
            profile, d, t_len, cfg.block_t, b=b, h=h, t0=tile * cfg.block_t,
            k_ref=k_ref, v_ref=v_ref, out_refs=out_refs, address=address,
        )

    n_in = 7
    call = TRITON.pallas_call(
        kernel,
        grid=(bsz, -(-t_len // cfg.block_t), h_len),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes],
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"paged_append_{profile.value}_{order.value}_d{d}",
        input_output_aliases={n_in + i: i for i in range(len(planes))},
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(table_rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(valid, jnp.int32),
        view.block_tables,
        k,
        v,
        *planes,
    )
    return dict(zip(names, logical_planes(out, dtypes)))
