"""The attention program shared by the paged and the cyclic attention kernels (Triton).

One program handles one (row ``b``, KV head ``h``, query tile ``qt``, context split ``sp``).  Its
query rows are ``block_q`` query tokens times the ``G = Hq / H`` query heads of KV head ``h``
(row ``r`` is token ``qt * block_q + r // G``, query head ``h * G + r % G``), padded to a power of
two >= 16 (:func:`pallas_kernels.triton.config.query_rows`), so every K/V tile is loaded once per
KV head and reused by the whole group.

Keys are visited in steps of ``block_k`` logical positions.  A *key source* turns a step into
tile loads (paged: block-table lookups inside the kernel; cyclic: ring slots).  Loads of keys
outside ``[lo, hi)`` are masked (value 0), so whatever lies in unwritten page columns, NaN poison
included, never reaches a product.  The scores and the value products are the codecs' tile
objects (:data:`pallas_kernels.common.codec_tiles.CODEC_TILES`: K and V dequantized in the
products), the softmax is the online softmax of :mod:`pallas_kernels.common.softmax`; the compute
dtype of the products is bfloat16 for bfloat16 queries and float32 (full-precision products)
otherwise, accumulation is always float32.

The context of a (row, query tile) is ``[lo, hi)`` with ``hi = min(kv_len, last query position +
1)`` and ``lo = 0``, or with a sliding ``window`` ``lo = first query position - window + 1`` (the
first key any query of the tile can see): the key loop starts at the step holding ``lo``, so steps
(pages) wholly before the window are never visited, neither their table entries nor their tiles;
its steps are divided among ``k_splits`` programs, so a context split covers only that range.

Variants (static specializations of :class:`AttentionSpec`; with all of them off the program is
exactly the plain causal one): ``window`` (above; visibility ``j > p - window`` per query),
``soft_cap`` (scores ``soft_cap * tanh(s / soft_cap)`` before masking and the softmax) and
``sinks`` (a float32 ``(Hq,)`` operand: query head ``hq``'s softmax starts from ``m = sinks[hq]``,
``l = 1``, i.e. a logit of zero value joins the denominator; with several context splits only split
0 starts there, so :func:`~pallas_kernels.common.softmax.combine_splits` counts it once).

With one split the program normalises and writes the output; otherwise it writes ``(acc, m, l)`` and
:func:`~pallas_kernels.common.softmax.combine_splits` merges them.

:func:`run_attention` is the public-op body (config check and resolution, head-dim limit,
``sm_scale`` default, plane check) and :func:`attention_call` builds and runs the kernel around a
key-source factory; both serve the paged and the cyclic ops.  Memory access, program ids and the
``pallas_call`` go through the backend object (:mod:`pallas_kernels.triton.backend`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ninfer_kv.schema.profiles import KVProfile

from ..common.codec_tiles import TileLoader, codec_tile
from ..common.config import ResolvedAttention
from ..common.softmax import combine_splits, compute_dtype_for, initial_state, normaliser, softmax_step, visible_keys
from ..common.tiles import F32, and_masks
from .backend import TRITON, TritonBackend, prepare
from .config import TritonConfig, lanes, query_rows

__all__ = [
    "AttentionSpec",
    "attention_program",
    "attention_call",
    "masked_tile_load",
    "run_attention",
    "resolution_keys",
    "variant_suffix",
]


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention kernel instance."""

    profile: KVProfile
    head_dim: int
    num_queries: int  # T
    group: int  # Hq / H
    cfg: ResolvedAttention
    compiler: TritonConfig  # resolved
    sm_scale: float
    compute_dtype: object  # jnp.bfloat16 or jnp.float32
    window: int | None = None  # sliding window W (cyclic: the layout's; paged: the op's); None: full causal
    soft_cap: float | None = None  # scores become soft_cap * tanh(s / soft_cap); None: plain scores
    sinks: bool = False  # a float32 (Hq,) sink-logit operand follows the planes

    @property
    def rows(self) -> int:
        """Query rows of one program (padded to a power of two >= 16)."""
        return query_rows(self.cfg.block_q, self.group)


KeySource = Callable[[jax.Array, jax.Array, jax.Array], tuple[TileLoader, jax.Array]]


def resolution_keys(max_keys: int, window: int | None, num_queries: int) -> int:
    """The ``max_keys`` a config is resolved with: the most keys one query tile can see (``max_keys``,
    or with a window at most ``window + num_queries - 1``), so a windowed row is not cut into context
    splits that would find nothing to read."""
    return max_keys if window is None else max(1, min(max_keys, window + num_queries - 1))


def variant_suffix(window: int | None, soft_cap: float | None, sinks) -> str:
    """The kernel-name suffix of the variant options (empty when all are off)."""
    return ((f"_w{window}" if window is not None else "") + (f"_cap{soft_cap:g}" if soft_cap is not None else "")
            + ("_sinks" if sinks is not None else ""))


def attention_program(
    spec: AttentionSpec,
    backend: TritonBackend,
    *,
    b,
    h,
    qt,
    sp,
    pos,
    kv_len,
    q_ref,
    key_source: KeySource,
    out_refs: tuple,
    key_floor=None,
    q_start=None,
    count=None,
    sinks_ref=None,
) -> None:
    """Run one attention program (see the module docstring).

    Args:
      spec: static kernel description.
      backend: the backend object (memory access).
      b, h, qt, sp: program ids (row, KV head, query tile, context split).
      pos, kv_len: the row's first query position and key count (int32 scalars).
      q_ref: queries ``(B, T, Hq, D)``.
      key_source: ``key_source(step, j, key_ok) -> (load, key_ok)`` where ``j`` are the step's
        logical key positions ``(block_k,)``, ``key_ok`` the keys to load (the source may clear
        more of them: keys whose block-table entry is not a page of the pool), and
        ``load(plane, cols_or_lane)`` returns the masked tile ``(block_k, n)`` (or ``(block_k,)``
        for one lane) of that plane.
      key_floor: optional int32 scalar: keys below it are never visited (the cyclic view holds
        only the most recent ``slots`` positions).
      out_refs: ``(out,)`` with out ``(B, T, Hq, D)`` when there is one split, else
        ``(acc, m, l)`` with acc ``(S, B, T, Hq, D)`` float32 and m, l ``(S, B, T, Hq)`` float32.
      q_start, count: a block of a ragged call (:mod:`pallas_kernels.common.ragged`; ``qt`` is 0):
        its query ``i < count`` is token ``q_start + i`` of ``q_ref (1, N, Hq, D)`` at position
        ``pos + i``, and its output goes to token ``i`` of block ``b`` (out ``(nb, block_q, Hq, D)``,
        acc and m, l likewise).  ``None``: the rectangular tile ``qt`` of row ``b``.
      sinks_ref: the sink logits ``(Hq,)`` float32 when ``spec.sinks``, else ``None``.
    """
    cfg = spec.cfg
    d, g_size, bq, bk, rows = spec.head_dim, spec.group, cfg.block_q, cfg.block_k, spec.rows
    cdt = spec.compute_dtype
    tile_lanes = lanes(d)
    k_tile, v_tile = codec_tile(spec.profile.k_codec), codec_tile(spec.profile.v_codec)

    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    local = jax.lax.div(r, jnp.int32(g_size))  # the row's query within the tile
    if count is None:  # tile qt of a rectangular row: tokens qt * bq + local of row b
        tq = qt * bq + local
        row_ok = (r < bq * g_size) & (tq < spec.num_queries)
        first_pos = pos + qt * bq  # the tile's first query position
        n_queries = jnp.minimum(spec.num_queries - qt * bq, bq)
        q_row, tq_out, out_len = b, tq, spec.num_queries
    else:  # a ragged block: tokens q_start + local of the call, output rows local of block b
        row_ok = (r < bq * g_size) & (local < count)
        first_pos, n_queries = pos, count
        q_row, tq, tq_out, out_len = 0, q_start + local, local, bq
    # Padding rows load token 0 (masked) and store past the output's token axis: out of range, so a
    # masked store can never alias a real row (the interpreter's scatter drops it; the GPU store is masked).
    tq_store = jnp.where(row_ok, tq_out, out_len)
    tq = jnp.where(row_ok, tq, 0)
    hq = h * g_size + jax.lax.rem(r, jnp.int32(g_size))
    qpos = jnp.where(row_ok, first_pos + local, -1)

    hi = jnp.minimum(kv_len, first_pos + n_queries)
    lo = jnp.int32(0)
    if spec.window is not None:
        lo = jnp.maximum(lo, first_pos - spec.window + 1)
    if key_floor is not None:
        lo = jnp.maximum(lo, key_floor)
    step_lo = jax.lax.div(lo, jnp.int32(bk))
    step_hi = jnp.where(hi > lo, jax.lax.div(hi + (bk - 1), jnp.int32(bk)), step_lo)
    per_split = jax.lax.div(step_hi - step_lo + (cfg.k_splits - 1), jnp.int32(cfg.k_splits))
    first = step_lo + sp * per_split
    last = jnp.maximum(jnp.minimum(step_hi, first + per_split), first)

    row_ok2 = row_ok[:, None]
    qs = [
        backend.load(
            q_ref.at[q_row, tq[:, None], hq[:, None], cols.index()], mask=and_masks(row_ok2, cols.mask()), other=0
        ).astype(cdt)
        for cols in k_tile.columns(tile_lanes)
    ]
    vcols = v_tile.columns(tile_lanes)
    sm_scale = F32(spec.sm_scale)
    soft_cap = None if spec.soft_cap is None else F32(spec.soft_cap)
    state = initial_state(rows, [c.n for c in vcols])
    if spec.sinks:
        # The sink is a logit of zero value: the running max starts at it and the sum at exp(0) = 1.
        # With several splits only split 0 holds it (combine_splits then counts it once).
        sink = backend.load(sinks_ref.at[hq]).astype(F32)
        one = jnp.ones((rows,), F32)
        if cfg.k_splits == 1:
            state = (sink, one, *state[2:])
        else:
            holds = sp == 0
            state = (jnp.where(holds, sink, state[0]), jnp.where(holds, one, state[1]), *state[2:])

    def body(step, carry):
        m, l, *accs = carry
        j = step * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        key_ok = (j >= lo) & (j < hi)
        load, key_ok = key_source(step, j, key_ok)
        s = k_tile.decode_keys(qs, load, tile_lanes, cdt) * sm_scale
        if spec.soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        m, l, accs, p = softmax_step(m, l, accs, s, visible_keys(j, qpos, key_ok, spec.window))
        return (m, l, *v_tile.decode_values(accs, p, load, tile_lanes, cdt))

    m, l, *accs = jax.lax.fori_loop(first, last, body, state)

    if len(out_refs) == 1:
        (o_ref,) = out_refs
        inv = normaliser(l)
        for acc, cols in zip(accs, vcols):
            backend.store(
                o_ref.at[b, tq_store[:, None], hq[:, None], cols.index()], (acc * inv).astype(o_ref.dtype),
                mask=and_masks(row_ok2, cols.mask()),
            )
    else:
        acc_ref, m_ref, l_ref = out_refs
        for acc, cols in zip(accs, vcols):
            backend.store(
                acc_ref.at[sp, b, tq_store[:, None], hq[:, None], cols.index()], acc,
                mask=and_masks(row_ok2, cols.mask()),
            )
        backend.store(m_ref.at[sp, b, tq_store, hq], m, mask=row_ok)
        backend.store(l_ref.at[sp, b, tq_store, hq], l, mask=row_ok)


def masked_tile_load(backend: TritonBackend, ref_view, key_ok: jax.Array, cols) -> jax.Array:
    """Load a key tile (``(block_k, n)`` for lane rows, ``(block_k,)`` for one lane), 0 where not ``key_ok``.

    ``ref_view`` is a plane ref indexed by the tile's addresses (``plane.at[...]``).

    float8 planes are loaded without a fill value (the Triton lowering cannot build an f8 constant)
    and zeroed after an exact conversion to bfloat16.
    """
    mask = key_ok if isinstance(cols, int) else and_masks(key_ok[:, None], cols.mask())
    if jnp.dtype(ref_view.dtype).itemsize == 1 and jnp.issubdtype(ref_view.dtype, jnp.floating):
        tile = backend.load(ref_view, mask=mask).astype(jnp.bfloat16)
        return jnp.where(mask, tile, jnp.zeros((), jnp.bfloat16))
    return backend.load(ref_view, mask=mask, other=0)


def run_attention(
    op: str, config_type: type, kernel: Callable, q, view, rows, positions, kv_lens, *, max_keys: int, sm_scale,
    config, interpret, **options,
) -> jax.Array:
    """Body of a public attention op: default/check ``config``, check the head dim and the planes, resolve, run.

    ``config`` must be ``None`` (a default ``config_type()``) or a ``config_type`` (its
    ``compiler`` a :class:`~pallas_kernels.triton.config.TritonConfig` or ``None``); it is resolved
    from the shapes of ``q (B, T, Hq, D)``, the view's KV heads and ``max_keys`` (the most keys a
    row can see).  ``sm_scale`` defaults to ``1 / sqrt(D)``.  ``kernel(backend, q, view, rows,
    positions, kv_lens, sm_scale=, cfg=, compiler=, interpret=, **options)`` computes the output;
    ``options`` (the paged op's ``window``, ``soft_cap``, ``sinks``) go to ``kernel`` as given, and
    a ``window`` also bounds the keys the config is resolved for (:func:`resolution_keys`).
    """
    config, compiler, interpret = prepare(config, config_type, view, interpret)
    lay = view.layout
    b, t, hq, d = q.shape
    cfg = config.resolve(
        num_queries=t, group=hq // lay.num_kv_heads, head_dim=d, batch=b, kv_heads=lay.num_kv_heads,
        max_keys=resolution_keys(max_keys, options.get("window"), t),
    )
    compiler = compiler.for_attention(d, query_rows(cfg.block_q, hq // lay.num_kv_heads))
    sm_scale = (1.0 / d**0.5) if sm_scale is None else float(sm_scale)
    return kernel(TRITON, q, view, rows, positions, kv_lens, sm_scale=sm_scale, cfg=cfg, compiler=compiler,
                  interpret=interpret, **options)


KeySourceFactory = Callable[..., KeySource]


def attention_call(
    backend: TritonBackend,
    *,
    q: jax.Array,
    view,
    names: list,
    rows,
    positions,
    kv_lens,
    tables: tuple,
    spec: AttentionSpec,
    interpret: bool,
    name: str,
    make_key_source: KeySourceFactory,
    row_limit: int,
    key_limit: int | None = None,
    key_floor_offset: int | None = None,
    starts: jax.Array | None = None,
    counts: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Run :func:`attention_program` over the grid ``(B, H, ceil(T / block_q), k_splits)``.

    The kernel's operands are ``layer (1,)``, ``rows``, ``positions``, ``kv_lens`` (int32
    ``(B,)``), the ``tables`` (e.g. the block tables), ``q`` and the planes ``names``.  Each
    program calls ``make_key_source(layer, row, h, plane_refs, *table_refs)`` for its key source;
    with ``key_floor_offset`` the program's key floor is ``positions[b] + key_floor_offset``.

    Out-of-range inputs (no check is possible under ``jit``): a row index ``rows[b]`` outside
    ``[0, row_limit)`` makes row ``b`` inert (no key is visited: zeros; the key source gets row
    0, a safe address); ``kv_lens[b]`` is clipped to ``[0, key_limit]``.
    Several splits are merged with :func:`~pallas_kernels.common.softmax.combine_splits`.  ``q``
    must be non-empty.

    With ``starts`` and ``counts`` the rows are the ``nb`` blocks of a ragged call
    (:mod:`pallas_kernels.common.ragged`; ``rows``, ``positions``, ``kv_lens`` per block), ``q`` is
    the call's ``(N, Hq, D)``, the grid ``(nb, H, 1, k_splits)`` and the result the blocks' outputs
    ``(nb, block_q, Hq, D)`` (rows past a block's count unspecified); ``starts`` and ``counts`` are
    two more scalar operands after ``kv_lens``.

    ``sinks`` (``(Hq,)`` float32; with ``spec.sinks``) is one more operand after the planes.
    """
    cfg, splits = spec.cfg, spec.cfg.k_splits
    n_tables, n_planes = len(tables), len(names)
    if spec.sinks != (sinks is not None):
        raise ValueError("attention_call: pass sinks exactly when spec.sinks is set")
    tail = () if sinks is None else (jnp.asarray(sinks, jnp.float32),)
    ragged = starts is not None
    if ragged:
        extra = (jnp.asarray(starts, jnp.int32), jnp.asarray(counts, jnp.int32))
        out_dims, q_tiles, q = (jnp.shape(rows)[0], cfg.block_q, *q.shape[1:]), 1, q[None]
    else:
        extra, out_dims, q_tiles = (), q.shape, -(-q.shape[1] // cfg.block_q)

    def kernel(layer_ref, rows_ref, pos_ref, lens_ref, *refs):
        block_refs, refs = refs[:len(extra)], refs[len(extra):]
        table_refs = refs[:n_tables]
        q_ref = refs[n_tables]
        plane_refs = dict(zip(names, refs[n_tables + 1:n_tables + 1 + n_planes]))
        sink_refs = refs[n_tables + 1 + n_planes:n_tables + 1 + n_planes + len(tail)]
        out_refs = refs[n_tables + 1 + n_planes + len(tail):]
        b, h, qt, sp = (backend.program_id(i) for i in range(4))
        pos = backend.load_scalar(pos_ref, (b,))
        row = backend.load_scalar(rows_ref, (b,))
        row_ok = (row >= 0) & (row < row_limit)
        kv_len = backend.load_scalar(lens_ref, (b,))
        kv_len = kv_len if key_limit is None else jnp.minimum(kv_len, key_limit)
        kv_len = jnp.where(row_ok, jnp.maximum(kv_len, 0), 0)
        layer = backend.load_scalar(layer_ref, (0,))
        key_source = make_key_source(layer, jnp.where(row_ok, row, 0), h, plane_refs, *table_refs)
        attention_program(
            spec, backend, b=b, h=h, qt=qt, sp=sp, pos=pos, kv_len=kv_len, q_ref=q_ref, key_source=key_source,
            out_refs=out_refs, key_floor=None if key_floor_offset is None else pos + key_floor_offset,
            **({"q_start": backend.load_scalar(block_refs[0], (b,)), "count": backend.load_scalar(block_refs[1], (b,))}
               if ragged else {}),
            **({"sinks_ref": sink_refs[0]} if tail else {}),
        )

    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(out_dims, q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, *out_dims), jnp.float32),
            jax.ShapeDtypeStruct((splits, *out_dims[:-1]), jnp.float32),
            jax.ShapeDtypeStruct((splits, *out_dims[:-1]), jnp.float32),
        ]
    call = backend.pallas_call(
        kernel,
        grid=(out_dims[0], view.layout.num_kv_heads, q_tiles, splits),
        out_shape=out_shape,
        compiler=spec.compiler,
        interpret=interpret,
        name=name,
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(kv_lens, jnp.int32),
        *extra,
        *tables,
        q,
        *[view.planes[n] for n in names],
        *tail,
    )
    if splits == 1:
        return out[0]
    return combine_splits(*out, dtype=q.dtype)
