"""Paged append on Mosaic TPU: quantize K/V in VMEM and merge the new rows into their pages.

Grid ``(B, H)``: one program per (batch row, KV head), both ``parallel``.  Scalar-prefetch
operands (SMEM): ``layer (1,)``, ``table_rows``, ``positions``, ``valid`` (``(B,)``) and the
block tables flattened to ``(C * L,)`` (a 1-D SMEM array pads nothing).  ``k`` and ``v`` travel
as ``(B, H, T, D)`` blocks ``(T, D)`` (a whole-extent block: its last two dims equal the
array's, as TPU tiling requires); an NVFP4 tensor comes with its lanes permuted to ``[even |
odd]`` so that its quantizer reads both halves unstrided.  The program encodes all ``T`` tokens
with the codecs' TPU tiles (:data:`pallas_kernels.mosaic_tpu.tpu_tiles.TPU_TILES`: the shared
encoders, with int32 quantizer twins for INT8 and NVFP4, Mosaic having no 8-bit vector
arithmetic) into one int32 VMEM buffer ``(W * 64, X)`` per plane.

The planes stay in HBM (``memory_space=pltpu.HBM``) and are aliased input -> output.  A DMA into
a tiled HBM page must start at a tile boundary (8 rows for 32/16-bit, 32 for 8-bit planes), so a
single token row cannot be written by itself: the tokens' ``W = ceil((T + 63) / 64)`` logical
blocks ("windows") starting at ``positions[b] // 64`` are each read whole (``(64, X)`` per plane)
into VMEM when the block is mapped and holds a kept token, the new rows are merged in (the
encoded rows rolled by ``positions[b] % 64`` along the sublanes, a select on the rows that hold
kept tokens, everything widened to int32 and narrowed back at the store), and the page is written
back whole.  Rows that hold no new token are written back with their old bits.  Float planes
travel bitcast to unsigned integers of their width, so the DMAs move raw bits.  Two programs
appending to the same (page, head) at once would race on the read-modify-write; the rows of a
batch map distinct pages (on one-TensorCore chips the programs run one after another anyway).
The ragged append (:mod:`pallas_kernels.mosaic_tpu.ragged`) runs the same kernel over row blocks
(:func:`append_blocks`); its page blocks hold the tokens of one logical page, so each program reads
and rewrites one window and no two programs of a call share a page.

Rules (as :mod:`ninfer_kv.ops.reference`): a ``table_rows[b]`` outside ``[0, C)`` writes
nothing; tokens at positions outside ``[0, L * 64)`` and tokens whose table entry is outside
``[0, N)`` (the sentinel ``-1`` included) are dropped; ``valid`` is clipped to ``[0, T]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ninfer_kv.ops.views import PagedKVBatchLayerView

from ..common.config import PagedAppendConfig
from ..common.tiles import F32
from .backend import lanes, page_tile, prepare, read_cols
from .tpu_tiles import tpu_tile, widen

__all__ = ["paged_append", "append_blocks"]


def _storage_dtype(dtype):
    dtype = jnp.dtype(dtype)
    return jnp.dtype(f"uint{8 * dtype.itemsize}") if jnp.issubdtype(dtype, jnp.floating) else dtype


def _as_storage(x: jax.Array) -> jax.Array:
    dt = _storage_dtype(x.dtype)
    return x if dt == x.dtype else jax.lax.bitcast_convert_type(x, dt)


def paged_append(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    *,
    config: PagedAppendConfig | None = None,
    interpret=None,
) -> PagedKVBatchLayerView:
    """Quantize ``k, v (B, T, H, D)`` per the view's profile and append them in place.

    Args:
      view: the pool's batch view (stacked planes, block tables ``int32 (C, L)``, layer).
      table_rows, positions, valid: int32 ``(B,)``.
      k, v: ``(B, T, H, D)`` float32 or bfloat16.
      config: a :class:`PagedAppendConfig` (its ``compiler`` a
        :class:`~pallas_kernels.mosaic_tpu.backend.MosaicConfig` or ``None``; ``block_t`` is not
        used: a program encodes all ``T`` tokens of its row and head).
      interpret: ``None``: TPU interpret mode unless the default backend is a TPU; ``True``,
        ``False`` or a ``pltpu.InterpretParams``.
    Returns: the view with the updated planes (the same buffers when the caller donated them).
    """
    config, compiler, interpret = prepare(config, PagedAppendConfig, view, interpret)
    lay = view.layout
    bsz, t_len, h_len, d = k.shape
    if bsz == 0 or t_len == 0:
        return view
    return append_blocks(view, table_rows, positions, k, v, valid, compiler=compiler, interpret=interpret,
                         name=f"mosaic_paged_append_{lay.profile.value}_{lay.order.value}_d{d}")


def append_blocks(view: PagedKVBatchLayerView, table_rows: jax.Array, positions: jax.Array, k: jax.Array,
                  v: jax.Array, valid: jax.Array, *, compiler, interpret, name: str,
                  one_page: bool = False) -> PagedKVBatchLayerView:
    """The ``pallas_call`` of :func:`paged_append` over ``k, v (B, T, H, D)``: grid ``(B, H)``.

    ``one_page``: the caller guarantees that the kept tokens of every row lie in one logical page
    (``positions[b] % 64 + valid[b] <= 64``, as the page blocks of a ragged call,
    :mod:`pallas_kernels.mosaic_tpu.ragged`), so a program reads and rewrites one window
    (``T <= 64``) instead of ``ceil((T + 63) / 64)``; tokens past the page would be dropped.
    """
    lay = view.layout
    bsz, t_len, h_len, d = k.shape
    names = list(lay.plane_names)
    dtypes = {n: view.planes[n].dtype for n in names}
    planes = [_as_storage(view.planes[n]) for n in names]
    extents = {n: view.planes[n].shape[-1] for n in names}
    c_len, l_len = view.block_tables.shape
    page = lay.page_size
    if one_page and t_len > page:
        raise ValueError(f"one_page blocks hold at most {page} tokens, got T={t_len}")
    n_windows = 1 if one_page else -(-(t_len + page - 1) // page)  # pages a program's tokens can touch
    t_pad = n_windows * page
    kernel = functools.partial(
        _kernel, profile=lay.profile, order=lay.order, names=names, dtypes=dtypes, t_len=t_len, d=d,
        rows_limit=c_len, n_blocks=l_len, n_pages=view.num_pages, page=page, n_windows=n_windows)
    x_spec = pl.BlockSpec((None, None, t_len, d), lambda b, h, *_: (b, h, 0, 0))
    hbm_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(bsz, h_len),
        in_specs=[x_spec, x_spec] + [hbm_spec] * len(planes),
        out_specs=[hbm_spec] * len(planes),
        scratch_shapes=[pltpu.VMEM((t_pad, extents[n]), jnp.int32) for n in names]
        + [pltpu.VMEM((n_windows, page, extents[n]), p.dtype) for n, p in zip(names, planes)]
        + [pltpu.SemaphoreType.DMA((n_windows, len(planes)))],
    )
    call = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes],
        input_output_aliases={7 + i: i for i in range(len(planes))},
        compiler_params=compiler.params(("parallel", "parallel")),
        interpret=interpret,
        name=name,
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(table_rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(valid, jnp.int32),
        jnp.reshape(view.block_tables.astype(jnp.int32), (-1,)),
        jnp.swapaxes(_lanes_for(tpu_tile(lay.profile.k_codec), k), 1, 2),
        jnp.swapaxes(_lanes_for(tpu_tile(lay.profile.v_codec), v), 1, 2),
        *planes,
    )
    new = {n: o if o.dtype == dtypes[n] else jax.lax.bitcast_convert_type(o, dtypes[n]) for n, o in zip(names, out)}
    return view.replace(planes=new)


def _lanes_for(tile, x: jax.Array) -> jax.Array:
    """``x``'s lanes as ``[even | odd]`` when the tile's quantizer reads the halves unstrided, else ``x``."""
    if tile.permutes_lanes:
        return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return x


def _kernel(layer_ref, rows_ref, pos_ref, valid_ref, table_ref, k_ref, v_ref, *refs, profile, order, names, dtypes,
            t_len, d, rows_limit, n_blocks, n_pages, page, n_windows):
    n = len(names)
    out_refs = dict(zip(names, refs[n:2 * n]))
    bufs = dict(zip(names, refs[2 * n:3 * n]))
    pages = dict(zip(names, refs[3 * n:4 * n]))
    sems = refs[4 * n]
    b, h = pl.program_id(0), pl.program_id(1)
    tile_lanes = lanes(d)

    # Encode every token of (b, h) into the int32 row buffers (rows past T are never selected).
    for tensor, x_ref in (("k", k_ref), ("v", v_ref)):
        tile = tpu_tile(profile.codec(tensor))

        def x(cols, x_ref=x_ref, perm=tile.permutes_lanes):
            if perm and cols.stride == 2:  # NVFP4: the wrapper gave the lanes as [even | odd]
                return x_ref[:, pl.ds(cols.start * (d // 2), cols.n)].astype(F32)
            return read_cols(x_ref, cols).astype(F32)

        for put in tile.encode(tensor, x, tile_lanes):
            buf = bufs[put.plane]
            value = put.value
            if value.dtype != jnp.int32:
                value = widen(_as_storage(value.astype(dtypes[put.plane])))
            if isinstance(put.where, int):
                buf[0:t_len, put.where:put.where + 1] = value if value.ndim == 2 else value[:, None]
            else:
                buf[0:t_len, put.where.start:put.where.start + put.where.n] = value

    row = rows_ref[b]
    row_ok = (row >= 0) & (row < rows_limit)
    n_valid = jnp.where(row_ok, jnp.clip(valid_ref[b], 0, t_len), 0)
    row = jnp.where(row_ok, row, 0)
    layer, pos0 = layer_ref[0], pos_ref[b]
    shift = page.bit_length() - 1
    blk0 = jax.lax.shift_right_arithmetic(pos0, jnp.int32(shift))
    off0 = pos0 & jnp.int32(page - 1)

    # Window k is logical block blk0 + k; its row r holds token 64 k + r - off0.  A window whose block
    # is mapped and holds a kept token is read, merged with the new rows and written back whole
    # (DMAs into a tiled HBM page must start at a tile boundary, so single rows cannot be written).
    windows = []
    for k in range(n_windows):
        blk = blk0 + k
        first = k * page - off0
        keep = (blk >= 0) & (blk < n_blocks) & (first < n_valid)
        entry = table_ref[row * n_blocks + jnp.clip(blk, 0, n_blocks - 1)]
        keep = keep & (entry >= 0) & (entry < n_pages)
        pg = jnp.where(keep, entry, 0)
        copies = [(page_tile(out_refs[name], order, layer, pg, h), pages[name].at[k], sems.at[k, i])
                  for i, name in enumerate(names)]
        windows.append((keep, first, copies))

    def each(action):
        for keep, first, copies in windows:
            @pl.when(keep)
            def _():
                for c in copies:
                    action(*c)

    each(lambda hbm, vmem, sem: pltpu.make_async_copy(hbm, vmem, sem).start())
    each(lambda hbm, vmem, sem: pltpu.make_async_copy(hbm, vmem, sem).wait())
    rolled = {name: pltpu.roll(bufs[name][...], off0, 0) for name in names}
    for k, (keep, first, _) in enumerate(windows):
        @pl.when(keep)
        def _():
            t = first + jax.lax.broadcasted_iota(jnp.int32, (page, 1), 0)
            new = (t >= 0) & (t < n_valid)
            for name in names:
                old = pages[name][k]
                merged = jnp.where(new, rolled[name][k * page:(k + 1) * page], widen(old))
                pages[name][k] = merged.astype(old.dtype)

    each(lambda hbm, vmem, sem: pltpu.make_async_copy(vmem, hbm, sem).start())
    each(lambda hbm, vmem, sem: pltpu.make_async_copy(vmem, hbm, sem).wait())
