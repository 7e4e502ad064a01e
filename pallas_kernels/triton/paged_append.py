"""Paged append: quantize K/V in the kernel and write them in place into the stacked planes.

Row ``b`` writes tokens ``t < valid[b]`` at logical positions ``p = positions[b] + t`` into page
``block_tables[table_rows[b], p >> 6]``, column ``p & 63``, of layer ``layer`` (page-major planes
``(num_layers, N, H, 64, X)`` or head-major ``(num_layers, H, N, 64, X)``).  Positions whose block is
past the table width are dropped, like the reference.  The table lookup happens inside the kernel;
only entries of blocks that are actually written are read.

Out-of-range inputs under ``jit``: a ``table_rows[b]`` outside ``[0, C)`` writes nothing (no table
entry of it is read); tokens whose table entry is outside ``[0, N)`` and tokens at positions
outside ``[0, L * 64)`` are dropped; ``valid`` counts are clipped to ``[0, T]``.

The planes are passed whole and aliased input -> output (``input_output_aliases``), so under a
``jax.jit`` that donates them the append writes into the caller's buffers and copies nothing.

Grid: ``(B, ceil(T / block_t), H)``; each program quantizes ``block_t`` tokens of one (row, head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.ops.views import PagedKVBatchLayerView

from ..common.config import PagedAppendConfig
from .append import append_call, run_append
from .backend import TritonBackend

__all__ = ["paged_append", "paged_addresser"]


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
      config: block sizes and Triton knobs (default :class:`PagedAppendConfig`).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    Returns: the view with the updated planes (the same buffers when the caller donated them).
    """
    return run_append("paged_append", PagedAppendConfig, _paged_append_planes, view, table_rows, positions, k, v,
                      valid, config=config, interpret=interpret)


def _paged_append_planes(backend: TritonBackend, view, table_rows, positions, k, v, valid, *, config, compiler,
                         interpret) -> dict:
    lay = view.layout
    bsz, t_len = k.shape[:2]
    if bsz == 0 or t_len == 0:
        return dict(view.planes)
    return append_call(
        backend, view=view, names=list(lay.plane_names), rows=table_rows, positions=positions, valid=valid,
        tables=(view.block_tables,), k=k, v=v, cfg=config.for_tokens(t_len), compiler=compiler, interpret=interpret,
        name=f"paged_append_{lay.profile.value}_{lay.order.value}_d{lay.head_dim}",
        make_address=paged_addresser(backend, view, interpret), row_limit=view.block_tables.shape[0],
    )


def paged_addresser(backend: TritonBackend, view: PagedKVBatchLayerView, interpret: bool):
    """The addresser factory of the paged append (:func:`~pallas_kernels.triton.append.append_call`):
    block-table lookups, tokens past the table or with an entry outside ``[0, N)`` dropped."""
    lay = view.layout
    order = lay.order
    n_pages = view.num_pages
    n_blocks = view.logical_pages
    page = lay.page_size
    shift = page.bit_length() - 1

    # Tokens that are not written get a page that cannot alias a written one: on a GPU page 0 (a
    # safe address; the store is masked), in the interpreter page N (its scatter drops it).
    drop_page = n_pages if interpret else 0

    def make_address(layer, row, pos, n_valid, h, bt_ref):
        def address(t):
            p = pos + t
            blk = jax.lax.shift_right_arithmetic(p, jnp.int32(shift))
            off = p & jnp.int32(page - 1)
            write = (t < n_valid) & (p >= 0) & (blk < n_blocks)
            pg = backend.load(bt_ref.at[row, jnp.where(write, blk, 0)], mask=write, other=0)
            write = write & (pg >= 0) & (pg < n_pages)  # an entry outside [0, N): the block is dropped
            pg = jnp.where(write, pg, drop_page)

            def index(cols):
                if cols.ndim == 0:
                    pp, oo = pg, off
                else:
                    pp, oo = pg[:, None], off[:, None]
                if order is PlaneOrder.PAGE_MAJOR:
                    return (layer, pp, h, oo, cols)
                return (layer, h, pp, oo, cols)

            return write, index

        return address

    return make_address
