"""Cyclic (ring-buffer) append and windowed attention for the DFlash local window.

Planes are ``(num_layers, rows, H, slots, X)``; key ``j`` of a row lives in slot ``j mod slots``.

* Append: row ``b`` writes tokens ``t < valid[b]`` at slots ``(positions[b] + t) mod slots`` of ring
  ``rows[b]``; when a chunk is longer than the ring only its last ``slots`` tokens are written (the
  earlier ones would be overwritten anyway, and skipping them keeps writes race-free).
* Attention: query ``t`` of row ``b`` sits at ``p = positions[b] + t`` and sees key ``j`` iff
  ``p - window < j <= p``, ``j < kv_lens[b]`` and ``j`` is one of the ``slots`` most recent
  positions of the row's chunk (``j > positions[b] + T - 1 - slots``; with the layout's
  ``slots >= window + T - 1`` this is implied by the window).
* A ring index outside ``[0, rows)`` makes the row inert (append writes nothing; attention
  returns zeros); tokens at negative positions are dropped and see no key.

Grids: append ``(B, ceil(T / block_t), H)``; attention ``(B, H, ceil(T / block_q), k_splits)``.
The codec arithmetic and the attention program are shared with the paged kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_kv.ops.views import CyclicKVCacheLayerView

from ..common.config import CyclicAppendConfig, CyclicAttentionConfig
from ..common.softmax import compute_dtype_for
from .append import append_call, run_append
from .attention import AttentionSpec, attention_call, masked_tile_load, run_attention
from .backend import TritonBackend

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
      config: block sizes and Triton knobs (default :class:`CyclicAppendConfig`).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    """
    return run_append("cyclic_append", CyclicAppendConfig, _cyclic_append_planes, view, rows, positions, k, v, valid,
                      config=config, interpret=interpret)


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
      config: block sizes and Triton knobs (default :class:`CyclicAttentionConfig`).
      interpret: run the Pallas interpreter; ``None``: iff the default backend is the CPU.
    """
    lay = view.layout
    return run_attention(
        "cyclic_attention", CyclicAttentionConfig, _cyclic_attention_kernel, q, view, rows, positions, kv_lens,
        max_keys=min(lay.slots, lay.window + q.shape[1] - 1), sm_scale=sm_scale, config=config, interpret=interpret,
    )


def _cyclic_append_planes(backend: TritonBackend, view, rows, positions, k, v, valid, *, config, compiler,
                          interpret) -> dict:
    lay = view.layout
    slots, n_rows = lay.slots, lay.rows
    bsz, t_len = k.shape[:2]
    if bsz == 0 or t_len == 0:
        return dict(view.planes)

    drop_ring = n_rows if interpret else 0  # never stored: out of range for the interpreter's scatter

    def make_address(layer, ring, pos, n_valid, h):
        def address(t):
            p = pos + t
            write = (t < n_valid) & (p >= 0) & (p > pos + n_valid - 1 - slots)
            slot = jax.lax.rem(jnp.where(write, p, 0), jnp.int32(slots))
            rr = jnp.where(write, ring, drop_ring)

            def index(cols):
                if cols.ndim == 0:
                    return (layer, rr, h, slot, cols)
                return (layer, rr[:, None], h, slot[:, None], cols)

            return write, index

        return address

    return append_call(
        backend, view=view, names=[p.name for p in lay.planes], rows=rows, positions=positions, valid=valid,
        tables=(), k=k, v=v, cfg=config.for_tokens(t_len), compiler=compiler, interpret=interpret,
        name=f"cyclic_append_{lay.profile.value}_d{lay.head_dim}", make_address=make_address, row_limit=n_rows,
    )


def _cyclic_attention_kernel(backend: TritonBackend, q, view, rows, positions, kv_lens, *, sm_scale, cfg, compiler,
                             interpret):
    lay = view.layout
    bsz, t_len, hq_len, d = q.shape
    if bsz == 0 or t_len == 0:
        return jnp.zeros(q.shape, q.dtype)
    slots, window = lay.slots, lay.window
    spec = AttentionSpec(
        profile=lay.profile, head_dim=d, num_queries=t_len, group=hq_len // lay.num_kv_heads, cfg=cfg,
        compiler=compiler, sm_scale=sm_scale, compute_dtype=compute_dtype_for(q.dtype), window=window,
    )

    def make_key_source(layer, ring, h, plane_refs):
        def key_source(step, j, key_ok):
            slot = jax.lax.rem(jnp.where(key_ok, j, 0), jnp.int32(slots))

            def load(name, cols):
                if isinstance(cols, int):
                    idx = (layer, ring, h, slot, jnp.int32(cols))
                else:
                    idx = (layer, ring, h, slot[:, None], cols.index())
                return masked_tile_load(backend, plane_refs[name].at[idx], key_ok, cols)

            return load, key_ok

        return key_source

    return attention_call(
        backend, q=q, view=view, names=[p.name for p in lay.planes], rows=rows, positions=positions,
        kv_lens=kv_lens, tables=(), spec=spec, interpret=interpret,
        name=f"cyclic_attention_{lay.profile.value}_d{d}_w{window}_q{cfg.block_q}_k{cfg.block_k}_s{cfg.k_splits}",
        make_key_source=make_key_source, row_limit=lay.rows,
        key_floor_offset=t_len - slots,  # the ring holds only the chunk's `slots` most recent positions
    )
