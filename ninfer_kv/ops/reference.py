"""float32 jnp reference implementations of the paged and cyclic ops (gather-based; for tests).

Semantics (the op contract of :mod:`ninfer_kv.ops`):

* ``paged_append``: row ``b`` writes tokens ``t < valid[b]`` at logical positions
  ``positions[b] + t``, quantized per the profile, into the page ``block_tables[table_rows[b],
  pos >> 6]`` at column ``pos & 63`` of layer ``layer``.  Nothing else changes.
* ``paged_attention``: query ``t`` of row ``b`` sits at ``p = positions[b] + t``; key ``j`` is
  visible iff ``j <= p and j < kv_lens[b]`` (and ``j > p - window`` with a ``window``).  Scores
  ``s = sm_scale * q.k`` in float32 over the dequantized keys (``soft_cap * tanh(s / soft_cap)``
  with a ``soft_cap``), softmax in float32 (with ``sinks``, ``exp(sinks[hq] - m)`` joins the
  denominator of query head ``hq``: a logit whose value is zero), output ``sum p_j v_j`` cast to
  ``q.dtype``; a query with no visible key returns zeros.  Query head ``hq`` reads KV head
  ``hq // (Hq // H)``.
* Cyclic ops: key ``j`` lives in ring slot ``j mod slots``; visible iff
  ``positions[b] + t - window < j <= positions[b] + t`` and ``j < kv_lens[b]``.

Out-of-range indices (possible only under ``jax.jit``; concrete inputs are checked by
:mod:`ninfer_kv.ops.validation`) follow the rules of :mod:`ninfer_kv.ops`, identically in every
implementation: a table row outside ``[0, C)`` (a cyclic row outside ``[0, rows)``) is inert
(nothing written, zeros returned); a block-table entry outside ``[0, N)`` drops the appended tokens
of its block and hides its keys from attention; positions outside ``[0, L * 64)`` are dropped;
attention reads ``clip(kv_lens, 0, L * 64)`` keys.

These functions gather whole table rows into contiguous float32 K/V: that is what makes them a
reference and what the kernels must never do.  Unread pages and table entries may hold anything
(NaN pages, out-of-range IDs): page IDs are clamped before the gather (the gathered keys of an
out-of-range entry are masked) and invalid keys are zeroed before they meet a probability, so
poison never leaks into a result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import codecs
from ..schema.geometry import PlaneOrder
from .views import CyclicKVCacheLayerView, PagedKVBatchLayerView
from .ragged import append_by_token, attention_by_token

__all__ = [
    "paged_append_reference",
    "paged_attention_reference",
    "paged_append_ragged_reference",
    "paged_attention_ragged_reference",
    "cyclic_append_reference",
    "cyclic_attention_reference",
    "attention_over_keys",
]

_F32 = jnp.float32


def _layer_slice(plane: jax.Array, layer) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(plane, jnp.asarray(layer, jnp.int32), axis=0, keepdims=False)


def attention_over_keys(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, sm_scale: float, *,
    soft_cap: float | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Masked GQA attention in float32.

    Args:
      q: ``(B, T, Hq, D)``.
      k, v: float32 ``(B, H, J, D)``.
      visible: bool ``(B, T, J)``.
      sm_scale: score scale.
      soft_cap: ``None``, or scores become ``soft_cap * tanh(s / soft_cap)`` before the softmax.
      sinks: ``None``, or ``(Hq,)`` logits that join each query head's softmax denominator.
    Returns: ``(B, T, Hq, D)`` float32; rows with no visible key are zero.
    """
    b, t, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    qf = q.astype(_F32).reshape(b, t, h, g, d)
    vis = visible[:, None, None, :, :]  # (B, 1, 1, T, J)
    k = jnp.where(jnp.any(visible, axis=1)[:, None, :, None], k, 0.0)
    v = jnp.where(jnp.any(visible, axis=1)[:, None, :, None], v, 0.0)
    s = jnp.einsum("bthgd,bhjd->bhgtj", qf, k, precision=jax.lax.Precision.HIGHEST) * _F32(sm_scale)
    if soft_cap is not None:
        s = _F32(soft_cap) * jnp.tanh(s / _F32(soft_cap))
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.asarray(sinks, _F32).reshape(1, h, g, 1, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    p = p / jnp.where(l > 0, l, 1.0)
    o = jnp.einsum("bhgtj,bhjd->bthgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(b, t, hq, d)


def _row_pages(view: PagedKVBatchLayerView, table_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Physical page of every logical block of each batch row ``(B, L)``, clamped into ``[0, N)``,
    and whether it is a real mapping (row in ``[0, C)`` and entry in ``[0, N)``)."""
    n, c = view.num_pages, view.max_concurrency
    rows = jnp.asarray(table_rows, jnp.int32)
    row_ok = (rows >= 0) & (rows < c)
    entries = view.block_tables[jnp.clip(rows, 0, c - 1)]  # (B, L)
    mapped = row_ok[:, None] & (entries >= 0) & (entries < n)
    return jnp.where(mapped, entries, 0), mapped


def _gather_rows(view: PagedKVBatchLayerView, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dequantized float32 K, V of every logical block of each row: ``(B, H, L * P, D)``."""
    lay = view.layout
    gathered = {}
    for name, plane in view.planes.items():
        layer_plane = _layer_slice(plane, view.layer)
        if lay.order is PlaneOrder.PAGE_MAJOR:  # (N, H, P, X)
            x = layer_plane[pages]  # (B, L, H, P, X)
        else:  # (H, N, P, X)
            x = jnp.moveaxis(layer_plane[:, pages], 0, 2)  # (B, L, H, P, X)
        bsz, nblk, h, p, ext = x.shape
        gathered[name] = jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(bsz, h, nblk * p, ext)
    k, v = codecs.decode_kv(lay.profile, gathered)
    return k, v


def paged_attention_reference(
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
) -> jax.Array:
    """Reference paged attention; see the module docstring for the visibility rule."""
    b, t, _, d = q.shape
    sm_scale = (1.0 / d**0.5) if sm_scale is None else sm_scale
    pages, mapped = _row_pages(view, table_rows)
    k, v = _gather_rows(view, pages)
    p = view.page_size
    j = jnp.arange(k.shape[2], dtype=jnp.int32)
    qpos = jnp.asarray(positions, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # (B, T)
    key_ok = mapped[:, j // p] & (j[None, :] < jnp.asarray(kv_lens, jnp.int32)[:, None])  # (B, J)
    visible = (j[None, None, :] <= qpos[:, :, None]) & key_ok[:, None, :]
    if window is not None:
        visible &= j[None, None, :] > qpos[:, :, None] - window
    return attention_over_keys(q, k, v, visible, sm_scale, soft_cap=soft_cap, sinks=sinks).astype(q.dtype)


def _bitwise_set(plane: jax.Array, index: tuple, vals: jax.Array) -> jax.Array:
    """``plane.at[index].set(vals, mode="drop")`` on the raw bits of float planes.

    XLA's CPU scatter canonicalizes NaN payloads of untouched bf16/fp8 elements; moving bits as
    unsigned integers keeps every byte outside ``index`` exactly as it was.
    """
    vals = vals.astype(plane.dtype)
    if not jnp.issubdtype(plane.dtype, jnp.floating):
        return plane.at[index].set(vals, mode="drop")
    bits = jnp.dtype(f"uint{8 * jnp.dtype(plane.dtype).itemsize}")
    raw = jax.lax.bitcast_convert_type(plane, bits)
    raw = raw.at[index].set(jax.lax.bitcast_convert_type(vals, bits), mode="drop")
    return jax.lax.bitcast_convert_type(raw, plane.dtype)


def _scatter_tokens(plane, layer, order: PlaneOrder, pages, offs, vals):
    """Write ``vals (n, H, X)`` at (layer, pages[i], :, offs[i], :); out-of-range pages are dropped."""
    layer = jnp.asarray(layer, jnp.int32)
    if order is PlaneOrder.PAGE_MAJOR:
        return _bitwise_set(plane, (layer, pages, slice(None), offs, slice(None)), vals)
    return _bitwise_set(plane, (layer, slice(None), pages, offs, slice(None)), vals)


def paged_append_reference(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
) -> PagedKVBatchLayerView:
    """Reference paged append; returns the view with the updated planes."""
    lay = view.layout
    b, t, h, d = k.shape
    n = view.num_pages
    p = lay.page_size
    nblk = view.logical_pages
    pos = jnp.asarray(positions, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # (B, T)
    write = jnp.arange(t, dtype=jnp.int32)[None, :] < jnp.asarray(valid, jnp.int32)[:, None]
    block = pos // p
    write = write & (block < nblk) & (pos >= 0)
    row_pages, mapped = _row_pages(view, table_rows)
    blk = jnp.clip(block, 0, nblk - 1)
    pages = jnp.take_along_axis(row_pages, blk, axis=1)
    write = write & jnp.take_along_axis(mapped, blk, axis=1)
    pages = jnp.where(write, pages, n)  # n is out of range: dropped (never a negative, wrapped index)
    offs = pos % p
    enc = codecs.encode_kv(lay.profile, k, v)  # each (B, T, H, X)
    new = {}
    for name, plane in view.planes.items():
        vals = enc[name].reshape((b * t,) + enc[name].shape[2:])
        new[name] = _scatter_tokens(plane, view.layer, lay.order, pages.reshape(-1), offs.reshape(-1), vals)
    return view.replace(planes=new)


def paged_append_ragged_reference(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_starts: jax.Array,
) -> PagedKVBatchLayerView:
    """Reference ragged append: the reference append over one token per row (:mod:`ninfer_kv.ops.ragged`)."""
    return append_by_token(paged_append_reference)(view, table_rows, positions, k, v, query_starts)


def paged_attention_ragged_reference(
    q: jax.Array,
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    query_starts: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Reference ragged attention: the reference attention over one query per row (:mod:`ninfer_kv.ops.ragged`)."""
    return attention_by_token(paged_attention_reference)(q, view, table_rows, positions, kv_lens, query_starts,
                                                         sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                                                         sinks=sinks)


# -- cyclic ----------------------------------------------------------------------------------------


def cyclic_append_reference(
    view: CyclicKVCacheLayerView,
    rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
) -> CyclicKVCacheLayerView:
    """Write tokens ``t < valid[b]`` of row ``rows[b]`` at ring slots ``(positions[b] + t) mod slots``."""
    lay = view.layout
    b, t, h, d = k.shape
    pos = jnp.asarray(positions, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.clip(jnp.asarray(valid, jnp.int32), 0, t)
    write = (jnp.arange(t, dtype=jnp.int32)[None, :] < valid[:, None]) & (pos >= 0)
    # Only the last `slots` written tokens of a row survive; drop earlier ones so duplicates never race.
    last = jnp.asarray(positions, jnp.int32)[:, None] + valid[:, None] - 1
    write = write & (pos > last - lay.slots)
    r = jnp.broadcast_to(jnp.asarray(rows, jnp.int32)[:, None], (b, t))
    write = write & (r >= 0) & (r < lay.rows)  # a row outside [0, rows) is inert
    r = jnp.where(write, r, lay.rows)  # lay.rows is out of range: dropped
    slot = pos % lay.slots
    enc = codecs.encode_kv(lay.profile, k, v)
    new = {}
    layer = jnp.asarray(view.layer, jnp.int32)
    for name, plane in view.planes.items():
        vals = enc[name].reshape((b * t,) + enc[name].shape[2:])
        new[name] = _bitwise_set(plane, (layer, r.reshape(-1), slice(None), slot.reshape(-1), slice(None)), vals)
    return view.replace(planes=new)


def cyclic_attention_reference(
    q: jax.Array,
    view: CyclicKVCacheLayerView,
    rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    """Reference windowed attention over ring buffers."""
    lay = view.layout
    b, t, _, d = q.shape
    sm_scale = (1.0 / d**0.5) if sm_scale is None else sm_scale
    rows = jnp.asarray(rows, jnp.int32)
    row_ok = (rows >= 0) & (rows < lay.rows)  # a row outside [0, rows) sees no key
    rows = jnp.clip(rows, 0, lay.rows - 1)
    planes = {name: _layer_slice(plane, view.layer)[rows] for name, plane in view.planes.items()}  # (B, H, S, X)
    k, v = codecs.decode_kv(lay.profile, planes)  # (B, H, slots, D)
    # Key j of query (b, t) lives in slot j mod slots; enumerate the `slots` most recent positions.
    qpos = jnp.asarray(positions, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # (B, T)
    top = jnp.asarray(positions, jnp.int32) + t - 1  # newest position any query of the row may see
    jpos = top[:, None] - jnp.arange(lay.slots, dtype=jnp.int32)[None, :]  # (B, slots), newest first
    slot = jnp.mod(jpos, lay.slots)
    k = jnp.take_along_axis(k, slot[:, None, :, None], axis=2)
    v = jnp.take_along_axis(v, slot[:, None, :, None], axis=2)
    kl = jnp.asarray(kv_lens, jnp.int32)[:, None, None]
    jp = jpos[:, None, :]
    visible = (jp <= qpos[:, :, None]) & (jp > qpos[:, :, None] - lay.window) & (jp < kl) & (jp >= 0)
    visible = visible & row_ok[:, None, None]
    return attention_over_keys(q, k, v, visible, sm_scale).astype(q.dtype)
