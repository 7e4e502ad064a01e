"""The attention program shared by the paged and the cyclic attention kernels.

One program handles one (row ``b``, KV head ``h``, query tile ``qt``, context split ``sp``).  Its
query rows are ``block_q`` query tokens times the ``G = Hq / H`` query heads of KV head ``h``
(row ``r`` is token ``qt * block_q + r // G``, query head ``h * G + r % G``), padded to a power of
two >= 16, so every K/V tile is loaded once per KV head and reused by the whole group.

Keys are visited in steps of ``block_k`` logical positions.  A *key source* turns a step into
tile loads (paged: block-table lookups inside the kernel; cyclic: ring slots).  Loads of keys
outside ``[lo, hi)`` are masked (value 0), so whatever lies in unwritten page columns, NaN poison
included, never reaches a product.  Visibility per (query, key) is ``key <= query position``
(and ``key > query position - window`` for the cyclic view); scores use an online softmax in
float32 (running max ``m``, sum ``l``, unnormalised accumulators).

K dequantization happens in the products: BF16 and FP8 codes convert exactly to the compute
dtype and the FP8 row scale multiplies the scores; INT8-G64 takes one product per group of 64
lanes, each scaled by its group scale; NVFP4 codes are dequantized (code * scale is exact in
bfloat16) and the even and odd lanes go through two products (``q_even . lo + q_odd . hi``), so
no interleaved tile is ever built.  V is handled the same way with the scale folded into the
probabilities.  The compute dtype of the products is bfloat16 for bfloat16 queries and float32
(full-precision products) otherwise; accumulation is always float32.

The context of a (row, query tile) is ``[lo, hi)`` with ``hi = min(kv_len, last query position +
1)``; its steps are divided among ``k_splits`` programs.  With one split the program normalises
and writes the output; otherwise it writes ``(acc, m, l)`` and :func:`combine_splits` merges them.

:func:`run_attention` is the public-op body (config check and resolution, head-dim limit,
``sm_scale`` default, kernel backend) and :func:`attention_call` builds and runs the kernel around
a key-source factory; both serve the paged and the cyclic ops.  Memory access, program ids and
the ``pallas_call`` go through the kernel backend object (:mod:`pallas_kernels.backend`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ninfer_kv.profiles import KVCodec, KVProfile

from .backend import KernelBackend, kernel_backend, resolve_interpret
from .codec_tiles import Cols, and_masks, fp8_bits_to_f32, nvfp4_dequantize_halves, value_columns
from .config import ResolvedAttention
from .limits import check_head_dim

__all__ = [
    "AttentionSpec",
    "attention_program",
    "attention_call",
    "combine_splits",
    "compute_dtype_for",
    "masked_tile_load",
    "run_attention",
    "M_INIT",
]

M_INIT = -1e30  # initial running max: finite, so exp(m_old - m_new) never sees inf - inf
_F32 = jnp.float32

TileLoader = Callable[[str, "Cols | int"], jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention kernel instance."""

    profile: KVProfile
    head_dim: int
    num_queries: int  # T
    group: int  # Hq / H
    cfg: ResolvedAttention
    sm_scale: float
    compute_dtype: object  # jnp.bfloat16 or jnp.float32
    window: int | None = None  # cyclic window W; None for paged attention


def _dot(a: jax.Array, b: jax.Array, transpose_b: bool) -> jax.Array:
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _nvfp4_tiles(load: TileLoader, name: str, d: int, cdt) -> tuple[jax.Array, jax.Array]:
    packed = load(name, Cols.padded(0, 1, d // 2, floor=16))
    scale = fp8_bits_to_f32(load(f"{name}_scale", Cols.padded(0, 1, d // 2, div=8, floor=16)))
    lo, hi = nvfp4_dequantize_halves(packed, scale)
    return lo.astype(cdt), hi.astype(cdt)


def _scores(codec: KVCodec, d: int, qs: list, load: TileLoader, cdt) -> jax.Array:
    """``q . k`` of the tile, float32 ``(rows, block_k)``, unscaled by ``sm_scale``."""
    if codec is KVCodec.BF16:
        return _dot(qs[0], load("k", value_columns(codec, d)[0]).astype(cdt), True)
    if codec is KVCodec.FP8_E4M3FN_ROW:
        s = _dot(qs[0], load("k", value_columns(codec, d)[0]).astype(cdt), True)
        return s * load("k_scale", 0).astype(_F32)[None, :]
    if codec is KVCodec.INT8_G64:
        total = None
        for g, cols in enumerate(value_columns(codec, d)):
            part = _dot(qs[g], load("k", cols).astype(cdt), True) * load("k_scale", g).astype(_F32)[None, :]
            total = part if total is None else total + part
        return total
    if codec is KVCodec.NVFP4_G16:
        lo, hi = _nvfp4_tiles(load, "k", d, cdt)
        return _dot(qs[0], lo, True) + _dot(qs[1], hi, True)
    raise ValueError(f"unsupported codec {codec}")  # pragma: no cover - KVCodec is closed


def _accumulate(codec: KVCodec, d: int, accs: list, p: jax.Array, load: TileLoader, cdt) -> list:
    """``accs + p @ v`` per value-column part."""
    if codec is KVCodec.BF16:
        return [accs[0] + _dot(p.astype(cdt), load("v", value_columns(codec, d)[0]).astype(cdt), False)]
    if codec is KVCodec.FP8_E4M3FN_ROW:
        ps = (p * load("v_scale", 0).astype(_F32)[None, :]).astype(cdt)
        return [accs[0] + _dot(ps, load("v", value_columns(codec, d)[0]).astype(cdt), False)]
    if codec is KVCodec.INT8_G64:
        out = []
        for g, cols in enumerate(value_columns(codec, d)):
            ps = (p * load("v_scale", g).astype(_F32)[None, :]).astype(cdt)
            out.append(accs[g] + _dot(ps, load("v", cols).astype(cdt), False))
        return out
    if codec is KVCodec.NVFP4_G16:
        lo, hi = _nvfp4_tiles(load, "v", d, cdt)
        pc = p.astype(cdt)
        return [accs[0] + _dot(pc, lo, False), accs[1] + _dot(pc, hi, False)]
    raise ValueError(f"unsupported codec {codec}")  # pragma: no cover - KVCodec is closed


KeySource = Callable[[jax.Array, jax.Array, jax.Array], tuple[TileLoader, jax.Array]]


def attention_program(
    spec: AttentionSpec,
    backend: KernelBackend,
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
) -> None:
    """Run one attention program (see the module docstring).

    Args:
      spec: static kernel description.
      backend: the kernel backend (memory access).
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
    """
    cfg = spec.cfg
    d, g_size, bq, bk, rows = spec.head_dim, spec.group, cfg.block_q, cfg.block_k, cfg.rows
    cdt = spec.compute_dtype
    profile = spec.profile

    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    tq = qt * bq + jax.lax.div(r, jnp.int32(g_size))
    row_ok = (r < bq * g_size) & (tq < spec.num_queries)
    # Padding rows load token 0 (masked) and store to token T: out of range, so a masked store can
    # never alias a real row (the interpreter's scatter drops it; the GPU store is masked).
    tq_store = jnp.where(row_ok, tq, spec.num_queries)
    tq = jnp.where(row_ok, tq, 0)
    hq = h * g_size + jax.lax.rem(r, jnp.int32(g_size))
    qpos = jnp.where(row_ok, pos + tq, -1)

    t_lo = qt * bq
    t_hi = jnp.minimum(spec.num_queries, t_lo + bq) - 1
    hi = jnp.minimum(kv_len, pos + t_hi + 1)
    lo = jnp.int32(0)
    if spec.window is not None:
        lo = jnp.maximum(lo, pos + t_lo - spec.window + 1)
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
            q_ref.at[b, tq[:, None], hq[:, None], cols.index()], mask=and_masks(row_ok2, cols.mask()), other=0
        ).astype(cdt)
        for cols in value_columns(profile.k_codec, d)
    ]
    vcols = value_columns(profile.v_codec, d)
    sm_scale = _F32(spec.sm_scale)

    def body(step, carry):
        m, l, *accs = carry
        j = step * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
        key_ok = (j >= lo) & (j < hi)
        load, key_ok = key_source(step, j, key_ok)
        s = _scores(profile.k_codec, d, qs, load, cdt) * sm_scale
        visible = key_ok[None, :] & (j[None, :] <= qpos[:, None])
        if spec.window is not None:
            visible = visible & (j[None, :] > qpos[:, None] - spec.window)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = l * alpha + jnp.sum(p, axis=1)
        accs = [a * alpha[:, None] for a in accs]
        accs = _accumulate(profile.v_codec, d, accs, p, load, cdt)
        return (m_new, l_new, *accs)

    init = (
        jnp.full((rows,), M_INIT, _F32),
        jnp.zeros((rows,), _F32),
        *[jnp.zeros((rows, c.n), _F32) for c in vcols],
    )
    m, l, *accs = jax.lax.fori_loop(first, last, body, init)

    if len(out_refs) == 1:
        (o_ref,) = out_refs
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)[:, None]
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


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """Merge per-split partials: acc ``(S, ..., D)``, m and l ``(S, ...)`` -> normalised ``(..., D)``."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    o = jnp.sum(w[..., None] * acc, axis=0)
    inv = jnp.where(l_all > 0, 1.0 / jnp.where(l_all > 0, l_all, 1.0), 0.0)
    return (o * inv[..., None]).astype(dtype)


def compute_dtype_for(q_dtype) -> object:
    """bfloat16 products for bfloat16 queries, full-precision float32 products otherwise."""
    return jnp.bfloat16 if jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32


def masked_tile_load(backend: KernelBackend, ref_view, key_ok: jax.Array, cols) -> jax.Array:
    """Load a key tile (``(block_k, n)`` for lane rows, ``(block_k,)`` for one lane), 0 where not ``key_ok``.

    ``ref_view`` is a plane ref indexed by the tile's addresses (``plane.at[...]``).

    float8 planes are loaded without a fill value (no backend needs to build an f8 constant; the
    Triton lowering cannot) and zeroed after an exact conversion to bfloat16.
    """
    mask = key_ok if isinstance(cols, int) else and_masks(key_ok[:, None], cols.mask())
    if jnp.dtype(ref_view.dtype).itemsize == 1 and jnp.issubdtype(ref_view.dtype, jnp.floating):
        tile = backend.load(ref_view, mask=mask).astype(jnp.bfloat16)
        return jnp.where(mask, tile, jnp.zeros((), jnp.bfloat16))
    return backend.load(ref_view, mask=mask, other=0)


def run_attention(
    op: str, config_type: type, kernel: Callable, q, view, rows, positions, kv_lens, *, max_keys: int, sm_scale,
    config, interpret,
) -> jax.Array:
    """Body of a public attention op: default/check ``config``, check the head dim, resolve, run.

    ``config`` must be ``None`` (a default ``config_type()``) or a ``config_type``; it is resolved
    from the shapes of ``q (B, T, Hq, D)``, the view's KV heads and ``max_keys`` (the most keys a
    row can see).  ``sm_scale`` defaults to ``1 / sqrt(D)``.  ``kernel(backend, q, view, rows,
    positions, kv_lens, sm_scale=, cfg=, interpret=)`` computes the output on the kernel backend
    ``config.backend`` names.
    """
    config = config_type() if config is None else config
    if not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__name__}, got {type(config).__name__}")
    lay = view.layout
    check_head_dim(lay.profile, lay.head_dim)
    interpret = resolve_interpret(interpret)
    backend = kernel_backend(config.backend, op)
    backend.check_planes(view.planes, interpret=interpret)
    b, t, hq, d = q.shape
    cfg = config.resolve(
        num_queries=t, group=hq // lay.num_kv_heads, head_dim=d, batch=b, kv_heads=lay.num_kv_heads,
        max_keys=max_keys,
    )
    sm_scale = (1.0 / d**0.5) if sm_scale is None else float(sm_scale)
    return kernel(backend, q, view, rows, positions, kv_lens, sm_scale=sm_scale, cfg=cfg, interpret=interpret)


KeySourceFactory = Callable[..., KeySource]


def attention_call(
    backend: KernelBackend,
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
) -> jax.Array:
    """Run :func:`attention_program` over the grid ``(B, H, ceil(T / block_q), k_splits)``.

    The kernel's operands are ``layer (1,)``, ``rows``, ``positions``, ``kv_lens`` (int32
    ``(B,)``), the ``tables`` (e.g. the block tables), ``q`` and the planes ``names``.  Each
    program calls ``make_key_source(layer, row, h, plane_refs, *table_refs)`` for its key source;
    with ``key_floor_offset`` the program's key floor is ``positions[b] + key_floor_offset``.

    Out-of-range inputs (no check is possible under ``jit``): a row index ``rows[b]`` outside
    ``[0, row_limit)`` makes row ``b`` inert (no key is visited: zeros; the key source gets row
    0, a safe address); ``kv_lens[b]`` is clipped to ``[0, key_limit]``.
    Several splits are merged with :func:`combine_splits`.  ``q`` must be non-empty.
    """
    cfg, splits = spec.cfg, spec.cfg.k_splits
    n_tables, n_planes = len(tables), len(names)

    def kernel(layer_ref, rows_ref, pos_ref, lens_ref, *refs):
        table_refs = refs[:n_tables]
        q_ref = refs[n_tables]
        plane_refs = dict(zip(names, refs[n_tables + 1:n_tables + 1 + n_planes]))
        out_refs = refs[n_tables + 1 + n_planes:]
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
        )

    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, *q.shape[:-1]), jnp.float32),
            jax.ShapeDtypeStruct((splits, *q.shape[:-1]), jnp.float32),
        ]
    call = backend.pallas_call(
        kernel,
        grid=(q.shape[0], view.layout.num_kv_heads, -(-q.shape[1] // cfg.block_q), splits),
        out_shape=out_shape,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=name,
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(kv_lens, jnp.int32),
        *tables,
        q,
        *[view.planes[n] for n in names],
    )
    if splits == 1:
        return out[0]
    return combine_splits(*out, dtype=q.dtype)
