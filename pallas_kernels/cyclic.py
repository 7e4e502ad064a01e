"""Cyclic (ring-buffer) append and windowed attention for the DFlash local window.

Planes are ``(num_layers, rows, H, slots, X)``; key ``j`` of a row lives in slot ``j mod slots``.

* Append: row ``b`` writes tokens ``t < valid[b]`` at slots ``(positions[b] + t) mod slots`` of ring
  ``rows[b]``; when a chunk is longer than the ring only its last ``slots`` tokens are written (the
  earlier ones would be overwritten anyway, and skipping them keeps writes race-free).
* Attention: query ``t`` of row ``b`` sits at ``p = positions[b] + t`` and sees key ``j`` iff
  ``p - window < j <= p``, ``j < kv_lens[b]`` and ``j`` is one of the ``slots`` most recent
  positions of the row's chunk (``j > positions[b] + T - 1 - slots``; with the layout's
  ``slots >= window + T - 1`` this is implied by the window).

Grids: append ``(B, ceil(T / block_t), H)``; attention ``(B, H, ceil(T / block_q), k_splits)``.
The codec arithmetic and the attention program are shared with the paged kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ninfer_kv.views import CyclicKVCacheLayerView

from .append_core import logical_planes, quantize_and_store, storage_planes
from .attention_core import AttentionSpec, attention_program, combine_splits, compute_dtype_for, masked_tile_load
from .backends import TRITON, implementation, register, resolve_interpret
from .config import CyclicAppendConfig, CyclicAttentionConfig
from .limits import check_head_dim

__all__ = ["cyclic_append", "cyclic_attention"]


def cyclic_append(
    view: CyclicKVCacheLayerView,
    rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    *,
    config: CyclicAppendConfig | None = None,
    interpret: bool | None = None,
) -> CyclicKVCacheLayerView:
    """Quantize ``k, v (B, T, H, D)`` and write them into ring ``rows[b]`` in place.

    Args:
      view: the cyclic view (stacked planes, layer).
      rows, positions, valid: int32 ``(B,)``.
      k, v: ``(B, T, H, D)`` float32 or bfloat16.
      config: block sizes (default :class:`CyclicAppendConfig`).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    """
    config = CyclicAppendConfig() if config is None else config
    if not isinstance(config, CyclicAppendConfig):
        raise TypeError(f"config must be a CyclicAppendConfig, got {type(config).__name__}")
    check_head_dim(view.layout.profile, view.layout.head_dim)
    impl = implementation("cyclic_append", config.backend)
    planes = impl(view, rows, positions, k, v, valid, config=config, interpret=resolve_interpret(interpret))
    return view.replace(planes=planes)


def cyclic_attention(
    q: jax.Array,
    view: CyclicKVCacheLayerView,
    rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    config: CyclicAttentionConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Windowed attention of ``q (B, T, Hq, D)`` over ring ``rows[b]``; returns ``(B, T, Hq, D)``.

    Args:
      q: queries, float32 or bfloat16.
      view: the cyclic view.
      rows, positions, kv_lens: int32 ``(B,)``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      config: block sizes (default :class:`CyclicAttentionConfig`).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    """
    config = CyclicAttentionConfig() if config is None else config
    if not isinstance(config, CyclicAttentionConfig):
        raise TypeError(f"config must be a CyclicAttentionConfig, got {type(config).__name__}")
    lay = view.layout
    check_head_dim(lay.profile, lay.head_dim)
    b, t, hq, d = q.shape
    cfg = config.resolve(
        num_queries=t, group=hq // lay.num_kv_heads, head_dim=d, batch=b, kv_heads=lay.num_kv_heads,
        max_keys=min(lay.slots, lay.window + t - 1),
    )
    sm_scale = (1.0 / d**0.5) if sm_scale is None else float(sm_scale)
    impl = implementation("cyclic_attention", cfg.backend)
    return impl(q, view, rows, positions, kv_lens, sm_scale=sm_scale, cfg=cfg, interpret=resolve_interpret(interpret))


@register("cyclic_append", "triton")
def _cyclic_append_triton(view, rows, positions, k, v, valid, *, config, interpret) -> dict:
    lay = view.layout
    profile, d, slots, n_rows = lay.profile, lay.head_dim, lay.slots, lay.rows
    bsz, t_len, h_len, _ = k.shape
    if bsz == 0 or t_len == 0:
        return dict(view.planes)
    cfg = config.for_tokens(t_len)
    names = [p.name for p in lay.planes]
    dtypes = [view.planes[n].dtype for n in names]
    planes = storage_planes([view.planes[n] for n in names], interpret)

    def kernel(layer_ref, rows_ref, pos_ref, valid_ref, k_ref, v_ref, *refs):
        out_refs = dict(zip(names, refs[len(names):]))
        b, tile, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        layer = layer_ref[0]
        ring = rows_ref[b]
        pos = pos_ref[b]
        n_valid = valid_ref[b]

        def address(t):
            p = pos + t
            write = (t < n_valid) & (p >= 0) & (p > pos + n_valid - 1 - slots)
            slot = jax.lax.rem(jnp.where(write, p, 0), jnp.int32(slots))
            rr = jnp.where(write, ring, n_rows)  # out of range: never stored

            def index(cols):
                if cols.ndim == 0:
                    return (layer, rr, h, slot, cols)
                return (layer, rr[:, None], h, slot[:, None], cols)

            return write, index

        quantize_and_store(
            profile, d, t_len, cfg.block_t, b=b, h=h, t0=tile * cfg.block_t,
            k_ref=k_ref, v_ref=v_ref, out_refs=out_refs, address=address,
        )

    n_in = 6
    call = TRITON.pallas_call(
        kernel,
        grid=(bsz, -(-t_len // cfg.block_t), h_len),
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes],
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=interpret,
        name=f"cyclic_append_{profile.value}_d{d}",
        input_output_aliases={n_in + i: i for i in range(len(planes))},
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(valid, jnp.int32),
        k,
        v,
        *planes,
    )
    return dict(zip(names, logical_planes(out, dtypes)))


@register("cyclic_attention", "triton")
def _cyclic_attention_triton(q, view, rows, positions, kv_lens, *, sm_scale, cfg, interpret):
    lay = view.layout
    bsz, t_len, hq_len, d = q.shape
    if bsz == 0 or t_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    h_len, slots, window = lay.num_kv_heads, lay.slots, lay.window
    names = [p.name for p in lay.planes]
    spec = AttentionSpec(
        profile=lay.profile, head_dim=d, num_queries=t_len, group=hq_len // h_len, cfg=cfg,
        sm_scale=sm_scale, compute_dtype=compute_dtype_for(q.dtype), window=window,
    )
    splits = cfg.k_splits

    def kernel(layer_ref, rows_ref, pos_ref, lens_ref, q_ref, *refs):
        plane_refs = dict(zip(names, refs[: len(names)]))
        out_refs = refs[len(names):]
        b, h, qt, sp = (pl.program_id(i) for i in range(4))
        layer = layer_ref[0]
        ring = rows_ref[b]
        pos = pos_ref[b]
        # Only the `slots` most recent positions of the chunk are held by the ring.
        kv_floor = pos + t_len - slots

        def key_source(step, j, key_ok):
            slot = jax.lax.rem(jnp.where(key_ok, j, 0), jnp.int32(slots))

            def load(name, cols):
                if isinstance(cols, int):
                    idx = (layer, ring, h, slot, jnp.int32(cols))
                else:
                    idx = (layer, ring, h, slot[:, None], cols.index())
                return masked_tile_load(plane_refs[name].at[idx], key_ok, cols)

            return load

        attention_program(
            spec, b=b, h=h, qt=qt, sp=sp, pos=pos, kv_len=lens_ref[b], q_ref=q_ref,
            key_source=key_source, out_refs=out_refs, key_floor=kv_floor,
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
        name=f"cyclic_attention_{lay.profile.value}_d{d}_w{window}_q{cfg.block_q}_k{cfg.block_k}_s{splits}",
    )
    out = call(
        jnp.reshape(jnp.asarray(view.layer, jnp.int32), (1,)),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(kv_lens, jnp.int32),
        q,
        *[view.planes[n] for n in names],
    )
    if splits == 1:
        return out[0]
    return combine_splits(*out, dtype=q.dtype)
