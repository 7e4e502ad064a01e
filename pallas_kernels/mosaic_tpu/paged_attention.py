"""Paged attention on Mosaic TPU: pages DMA'd from HBM into double-buffered VMEM, online softmax.

Grid ``(B, H, ceil(T / block_q))`` (``parallel, parallel, arbitrary``): one program per (batch
row, KV head, query tile).  Its ``block_q * G`` query rows (``G = Hq / H``; row ``r`` is token
``qt * block_q + r // G``, query head ``h * G + r % G``) come as one ``(block_q * G, D)`` block of
the queries rearranged to ``(B, H, Tp * G, D)``, so every page is read once per KV head and
reused by the whole GQA group.  Scalar-prefetch operands (SMEM): ``layer (1,)``, ``table_rows``,
``positions``, ``kv_lens`` (``(B,)``) and the block tables flattened to ``(C * L,)``.  The ragged
forms (:mod:`pallas_kernels.mosaic_tpu.ragged`) run the same kernel over row blocks
(:func:`attention_blocks`) with one more operand after ``kv_lens``, ``counts (B,)``: query ``t`` of
row ``b`` is real iff ``t < counts[b]`` and the row's last real query sets its key frontier.

Keys are visited a page (64 keys) at a time, only the pages below ``hi = min(kv_len, last (real)
query position + 1)``; with a sliding ``window`` the loop starts at the first page the block's first
query sees (:func:`first_page`: ``lo // 64``, ``lo = max(0, position - window + 1)``) and a block
whose keys ``[lo, hi)`` are empty fetches nothing, so pages wholly before every query's window are
never fetched.  Each plane has a VMEM scratch ``(2, 64, X)`` and two DMA semaphores: before the loop
the program starts the DMA of its first page ``f`` (0 without a window) into slot ``f % 2``; step
``i`` starts page ``i + 1`` into slot ``(i + 1) % 2``, waits for page ``i`` and computes on it while
the next one is in flight.  A table entry outside ``[0, N)`` (the sentinel included) or a row
outside ``[0, C)`` fetches page 0 instead and masks its keys, as the reference does; masked keys are
zeroed in the loads (codes and scales) before they meet a product, so NaN poison in unused pages or
columns never reaches the output.
Scores and value products are the TPU decoders of :mod:`pallas_kernels.mosaic_tpu.tpu_tiles`
(8-bit float planes are DMA'd as raw bytes and decoded with int32 arithmetic, every tile is widened
to int32 / float32 right after its load, per-key scales become score rows through an exact one-hot
product); the online softmax keeps ``m`` and ``l`` as ``(rows, 1)`` columns and builds every mask
from 2-D iotas (Mosaic cannot reshape 1-D bool vectors).  NVFP4 keys take the queries with their
lanes permuted to ``[even | odd]`` and NVFP4 values write ``[even | odd]`` output lanes; the wrapper
permutes both, so nothing is loaded strided.  bfloat16 queries give bfloat16 products, float32
queries full-precision float32 products, accumulation is float32.

Variants, each a static specialization (with all three ``None`` the kernel is the plain one):
``window`` (keys ``j > p - window`` of a query at ``p``, and the loop start above), ``soft_cap``
(scores ``soft_cap * tanh(s / soft_cap)`` before the mask) and ``sinks`` (one more input, a ``(rows,
1)`` float32 block of the rows' sink logits: the running max starts at the sink and the running sum
at ``exp(0) = 1``, the sink's value being zero; a row with no visible key still ends with a zero
accumulator and outputs zeros).

TPU layouts: every VMEM buffer's last two dims are a whole (tokens, lanes) extent: ``(64, X)``
pages (64 is a multiple of the 8 / 16 / 32 sublanes of 32- / 16- / 8-bit tiles) and ``(block_q *
G, D)`` query and output blocks (``block_q * G`` is a multiple of 8 or the whole padded extent).
The small scale planes (``X`` = 1, ``D / 64`` or ``D / 16`` lanes) are DMA'd as their own
``(64, X)`` tiles next to the codes; VMEM pads their lanes to 128, which costs VMEM but no extra
HBM traffic.  ``block_k`` and ``k_splits`` of the config are not used: a step is one page, and the
grid's parallel (row, head) axes are what a TPU's cores share.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.ops.views import PagedKVBatchLayerView

from ..common.config import PagedAttentionConfig
from ..common.softmax import M_INIT, compute_dtype_for
from ..common.tiles import F32
from .backend import page_tile, prepare
from .tpu_tiles import tpu_tile, widen

__all__ = ["paged_attention", "attention_blocks", "window_start", "first_page"]


@dataclasses.dataclass(frozen=True)
class _Spec:
    profile: KVProfile
    order: PlaneOrder
    names: tuple
    head_dim: int
    num_queries: int
    group: int
    block_q: int
    sm_scale: float
    rows_limit: int
    n_blocks: int
    n_pages: int
    page: int
    counted: bool = False  # a per-row ``counts`` scalar operand follows ``kv_lens``
    window: int | None = None  # sliding window (static): keys ``j > p - window`` of a query at ``p``
    soft_cap: float | None = None  # scores become ``soft_cap * tanh(s / soft_cap)``
    sinks: bool = False  # a ``(rows, 1)`` float32 block of sink logits follows the queries


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
    interpret=None,
) -> jax.Array:
    """Attention of ``q (B, T, Hq, D)`` over the pages of each row (see the module docstring).

    Args:
      q: queries, float32 or bfloat16.
      view: the pool's batch view.
      table_rows, positions, kv_lens: int32 ``(B,)``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      window: ``None`` or a static int ``>= 1``: a query at ``p`` sees only keys ``j > p - window``;
        a program's page loop starts at the first page its first query sees.
      soft_cap: ``None`` or a static float ``> 0``: scores become ``soft_cap * tanh(s / soft_cap)``.
      sinks: ``None`` or float ``(Hq,)``: one logit per query head in the softmax denominator.
      config: a :class:`PagedAttentionConfig` (``block_q`` used; its ``compiler`` a
        :class:`~pallas_kernels.mosaic_tpu.backend.MosaicConfig` or ``None``).
      interpret: ``None``: TPU interpret mode unless the default backend is a TPU; ``True``,
        ``False`` or a ``pltpu.InterpretParams``.
    Returns: ``(B, T, Hq, D)`` in ``q.dtype``.
    """
    config, compiler, interpret = prepare(config, PagedAttentionConfig, view, interpret)
    lay = view.layout
    bsz, t_len, hq_len, d = q.shape
    h_len = lay.num_kv_heads
    if bsz == 0 or t_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    group = hq_len // h_len
    c_len, l_len = view.block_tables.shape
    block_q = config.resolve(num_queries=t_len, group=group, head_dim=d, batch=bsz, kv_heads=h_len,
                             max_keys=l_len * lay.page_size).block_q
    block_q = max(block_q, -(-8 // group))  # query rows of a block: a multiple of 8 (or the whole extent)
    n_qt = -(-t_len // block_q)
    if n_qt == 1:
        block_q = t_len
    return attention_blocks(q, view, table_rows, positions, kv_lens, None, block_q=block_q, sm_scale=sm_scale,
                            window=window, soft_cap=soft_cap, sinks=sinks, compiler=compiler, interpret=interpret,
                            name=f"mosaic_paged_attention_{lay.profile.value}_{lay.order.value}_d{d}")


def attention_blocks(q: jax.Array, view: PagedKVBatchLayerView, table_rows: jax.Array, positions: jax.Array,
                     kv_lens: jax.Array, counts: jax.Array | None, *, block_q: int, sm_scale: float | None,
                     compiler, interpret, name: str, window: int | None = None, soft_cap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """The ``pallas_call`` of :func:`paged_attention` over ``q (B, T, Hq, D)``: grid ``(B, H, ceil(T / block_q))``.

    ``counts`` (int32 ``(B,)`` or ``None``) is an extra scalar-prefetch operand for blocks of a
    ragged call (:mod:`pallas_kernels.mosaic_tpu.ragged`): query ``t`` of row ``b`` is real iff
    ``t < counts[b]`` (clipped to ``[0, T]``), a padded query sees no key and returns zeros, and the
    row's key frontier is ``min(kv_len, position + counts[b])``.  ``None`` is the rectangular op: all
    ``T`` queries are real.  ``block_q`` must already be valid for the TPU tiling (``block_q * G`` a
    multiple of 8, or ``block_q == T``).

    ``window``, ``soft_cap`` and ``sinks`` (see :func:`paged_attention`) are static specializations:
    with all three ``None`` the kernel is the plain one.  ``sinks`` becomes a ``(H, block_q * G,
    1)`` float32 input (row ``r`` of KV head ``h``: ``sinks[h * G + r % G]``), one ``(block_q * G,
    1)`` VMEM block per program.
    """
    lay = view.layout
    bsz, t_len, hq_len, d = q.shape
    h_len = lay.num_kv_heads
    group = hq_len // h_len
    c_len, l_len = view.block_tables.shape
    n_qt = -(-t_len // block_q)
    t_pad = n_qt * block_q
    spec = _Spec(lay.profile, lay.order, tuple(lay.plane_names), d, t_len, group, block_q,
                 float(1.0 / d**0.5 if sm_scale is None else sm_scale), c_len, l_len, view.num_pages, lay.page_size,
                 counts is not None, None if window is None else int(window),
                 None if soft_cap is None else float(soft_cap), sinks is not None)
    k_tile, v_tile = tpu_tile(lay.profile.k_codec), tpu_tile(lay.profile.v_codec)
    if k_tile.permutes_lanes:  # queries' lanes as [even | odd] for the NVFP4 key products
        q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    qr = jnp.transpose(q.reshape(bsz, t_len, h_len, group, d), (0, 2, 1, 3, 4))
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, t_pad - t_len), (0, 0), (0, 0))).reshape(bsz, h_len, t_pad * group, d)
    planes = [_as_storage(view.planes[n]) for n in spec.names]
    scalars = [jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)), jnp.asarray(table_rows, jnp.int32),
               jnp.asarray(positions, jnp.int32), jnp.asarray(kv_lens, jnp.int32)]
    if counts is not None:
        scalars.append(jnp.asarray(counts, jnp.int32))
    scalars.append(jnp.reshape(view.block_tables.astype(jnp.int32), (-1,)))
    q_spec = pl.BlockSpec((None, None, block_q * group, d), lambda b, h, qt, *_: (b, h, qt, 0))
    extra_specs, extra = [], []
    if sinks is not None:  # row r of KV head h: query head h * G + r % G
        sink_rows = jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(h_len, 1, group), (1, block_q, 1))
        extra.append(sink_rows.reshape(h_len, block_q * group, 1))
        extra_specs.append(pl.BlockSpec((None, block_q * group, 1), lambda b, h, qt, *_: (h, 0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(bsz, h_len, n_qt),
        in_specs=[q_spec] + extra_specs + [pl.BlockSpec(memory_space=pl.ANY)] * len(planes),
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2, spec.page, p.shape[-1]), p.dtype) for p in planes]
        + [pltpu.SemaphoreType.DMA((2, len(planes)))],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, spec=spec),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=compiler.params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(*scalars, qr, *extra, *planes)
    out = jnp.transpose(out.reshape(bsz, h_len, t_pad, group, d)[:, :, :t_len], (0, 2, 1, 3, 4))
    out = out.reshape(bsz, t_len, hq_len, d)
    if v_tile.permutes_lanes:  # output lanes came as [even | odd]
        out = jnp.stack([out[..., :d // 2], out[..., d // 2:]], axis=-1).reshape(out.shape)
    return out


def window_start(first_query, window: int):
    """The first key a query at position ``first_query`` (or any later one) sees through a ``window``:
    ``max(0, first_query - window + 1)`` (an int32 scalar, computed without int32 overflow)."""
    back = jnp.int32(min(window, 2**31 - 1) - 1)
    return jnp.maximum(jnp.asarray(first_query, jnp.int32), back) - back


def first_page(first_query, window: int, page: int):
    """The first logical page a query at ``first_query`` (or any later one) sees through a ``window``:
    ``max(0, first_query - window + 1) // page``; a windowed program's page loop starts there."""
    return jax.lax.div(window_start(first_query, window), jnp.int32(page))


def _as_storage(x: jax.Array) -> jax.Array:
    """8-bit float planes as their raw bits (uint8): the kernel decodes them with integer arithmetic."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    return x


def _kernel(layer_ref, rows_ref, pos_ref, kvlen_ref, *refs, spec: _Spec):
    if spec.counted:
        count_ref, table_ref, q_ref, *refs = refs
    else:
        count_ref, (table_ref, q_ref, *refs) = None, refs
    sink_ref = None
    if spec.sinks:
        sink_ref, *refs = refs
    n = len(spec.names)
    plane_refs, bufs, sems = refs[:n], refs[n + 1:2 * n + 1], refs[2 * n + 1]
    o_ref = refs[n]
    b, h, qt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g_size, bq, page = spec.group, spec.block_q, spec.page
    rows = bq * g_size
    k_tile, v_tile = tpu_tile(spec.profile.k_codec), tpu_tile(spec.profile.v_codec)
    cdt = compute_dtype_for(q_ref.dtype)

    row = rows_ref[b]
    row_ok = (row >= 0) & (row < spec.rows_limit)
    row = jnp.where(row_ok, row, 0)
    layer, pos = layer_ref[0], pos_ref[b]
    kv_len = jnp.clip(kvlen_ref[b], 0, spec.n_blocks * page)
    # the row's real queries: all T, or its first counts[b] (a block of a ragged call)
    n_real = spec.num_queries if count_ref is None else jnp.clip(count_ref[b], 0, spec.num_queries)
    t_last = jnp.minimum(n_real, (qt + 1) * bq) - 1
    live = row_ok if count_ref is None else row_ok & (t_last >= qt * bq)
    hi = jnp.where(live, jnp.minimum(kv_len, pos + t_last + 1), 0)
    n_steps = jnp.where(hi > 0, jax.lax.div(hi + (page - 1), jnp.int32(page)), 0)
    first = 0
    if spec.window is not None:  # start at the first page any query of the block sees (its first query's)
        lo = window_start(pos + qt * bq, spec.window)
        first = jax.lax.div(lo, jnp.int32(page))
        n_steps = jnp.where(hi > lo, n_steps, 0)  # keys [lo, hi): none -> no page at all

    def fetch(i, slot):
        """The DMAs of logical page ``i`` of the row into ``slot``, and whether it is a real mapping."""
        entry = table_ref[row * spec.n_blocks + i]
        mapped = (entry >= 0) & (entry < spec.n_pages)
        pg = jnp.where(mapped, entry, 0)
        return mapped, [pltpu.make_async_copy(page_tile(p, spec.order, layer, pg, h), buf.at[slot], sems.at[slot, c])
                        for c, (p, buf) in enumerate(zip(plane_refs, bufs))]

    @pl.when(n_steps > first)
    def _():
        for c in fetch(first, 0 if spec.window is None else jax.lax.rem(first, 2))[1]:
            c.start()

    # Query rows as a (rows, 1) column: row r is token qt * bq + r // G.
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    tq = qt * bq + jax.lax.div(r, jnp.int32(g_size))
    qpos = jnp.where(tq < n_real, pos + tq, -1)
    d = spec.head_dim
    qs = [q_ref[:, start:start + width].astype(cdt) for start, width in k_tile.columns(d)]
    out_cols = v_tile.columns(d)
    sm_scale = F32(spec.sm_scale)
    names = spec.names

    def body(i, carry):
        m, l, *accs = carry
        slot = jax.lax.rem(i, 2)

        @pl.when(i + 1 < n_steps)
        def _():
            for c in fetch(i + 1, 1 - slot)[1]:
                c.start()

        mapped, copies = fetch(i, slot)
        for c in copies:
            c.wait()
        key_col = i * page + jax.lax.broadcasted_iota(jnp.int32, (page, 1), 0)
        ok_col = mapped & (key_col < kv_len)
        key_row = i * page + jax.lax.broadcasted_iota(jnp.int32, (rows, page), 1)
        visible = mapped & (key_row < kv_len) & (key_row <= qpos)
        if spec.window is not None:
            visible = visible & (key_row > qpos - jnp.int32(min(spec.window, 2**31 - 1)))

        def load(plane):
            if plane not in names:
                return None
            tile = widen(bufs[names.index(plane)][slot])
            return jnp.where(ok_col, tile, jnp.zeros((), tile.dtype))

        s = k_tile.decode_keys(qs, load("k"), load("k_scale"), cdt) * sm_scale
        if spec.soft_cap is not None:
            s = F32(spec.soft_cap) * jnp.tanh(s / F32(spec.soft_cap))
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l_new = l * alpha + jnp.sum(p, axis=1, keepdims=True)
        accs = [a * alpha for a in accs]
        return (m_new, l_new, *v_tile.decode_values(accs, p, load("v"), load("v_scale"), cdt))

    if sink_ref is None:
        m0, l0 = jnp.full((rows, 1), M_INIT, F32), jnp.zeros((rows, 1), F32)
    else:  # the sink is a logit with a zero value: the running max starts at it, its exp(0) = 1 in l
        m0, l0 = sink_ref[...].astype(F32), jnp.ones((rows, 1), F32)
    init = (m0, l0, *[jnp.zeros((rows, width), F32) for _, width in out_cols])
    m, l, *accs = jax.lax.fori_loop(first, n_steps, body, init)
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    for acc, (start, width) in zip(accs, out_cols):
        o_ref[:, start:start + width] = (acc * inv).astype(o_ref.dtype)
