"""The paged and cyclic KV ops as C++ XLA FFI CPU kernels (the ``"ffi"`` backend of :mod:`ninfer_kv.ops`).

The six ops have the signatures and semantics of :mod:`ninfer_kv.ops.reference`; inputs are
validated by :mod:`ninfer_kv.ops` before they get here.  They run as typed XLA FFI custom calls on
the CPU platform (the library, its loading and its instruction-set levels:
:mod:`ninfer_kv.ops.ffi.handlers`):

* ``paged_append`` / ``cyclic_append`` quantize with codes bit-identical to :mod:`ninfer_kv.ops.codecs`
  and write in place: every plane operand is aliased to its result (``input_output_aliases``), so
  a ``jax.jit`` caller that donates the planes gets no copy of them.
* ``paged_attention`` / ``cyclic_attention`` run a single-pass online softmax in float32 over the
  pages (or ring slots) each query sees, dequantizing page by page, with the work split over
  (batch row, KV head[, query block][, context split]) on a persistent thread pool.  They never
  read a page outside a row's visible range.  Their products are float32, except the scores of
  NVFP4 keys at the ``avx512vnni`` level, which multiply the query rounded to 15 bits with the
  key codes in integers (:func:`~ninfer_kv.ops.ffi.handlers.arithmetic` reports the products per
  profile; docs/ACCURACY.md measures what they add).
* the ``_ragged`` forms take the tokens of all rows one after another (no padding).
* the attention ops take three options (``window``, ``soft_cap``, ``sinks``, see
  :mod:`ninfer_kv.ops.reference`).  With all three ``None`` they make exactly the custom call they
  always made; otherwise they call the ``..._variants`` form of the handler, which takes ``sinks``
  as one more float32 operand (``(Hq,)``, or ``(0,)`` for none) and ``window`` / ``soft_cap`` as
  attributes (0 for none).  A sliding window narrows each query's visible keys, so the pages
  before the earliest window of a task are never read.

``jax.vmap`` over an op uses ``vmap_method="sequential"``: one custom call per mapped element.
The kernels are already batched over B, so vmap is a convenience, and "sequential" keeps two
properties the other methods lose: operands that are not mapped (the planes, above all) are
passed as they are instead of being broadcast to the mapped size, and an append mapped over
planes updates each element's planes separately.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...schema.geometry import PlaneOrder
from ...schema.profiles import KVProfile
from ..views import CyclicKVCacheLayerView, PagedKVBatchLayerView
from ..validation import check_attention_variant
from .handlers import _CODEC_ID, _NO_SPLITS, _i32, _require

__all__ = [
    "paged_append",
    "paged_attention",
    "paged_append_ragged",
    "paged_attention_ragged",
    "cyclic_append",
    "cyclic_attention",
]


def _codec_attrs(profile: KVProfile) -> dict:
    return {"k_codec": np.int32(_CODEC_ID[profile.k_codec]), "v_codec": np.int32(_CODEC_ID[profile.v_codec])}


def _plane_list(planes: dict, profile: KVProfile) -> list:
    """Planes in schema order (k, [k_scale], v, [v_scale]): the handlers' operand order."""
    return [planes[name] for name in profile.plane_names()]


def _layer(layer) -> jax.Array:
    return jnp.asarray(layer, jnp.int32).reshape(())


def _kv_inputs(k, v) -> tuple[jax.Array, jax.Array]:
    """k and v as one dtype the kernels read: both bfloat16, or both float32 (exact widening)."""
    k, v = jnp.asarray(k), jnp.asarray(v)
    if k.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16:
        return k, v
    return k.astype(jnp.float32), v.astype(jnp.float32)


def _query(q) -> jax.Array:
    q = jnp.asarray(q)
    return q if q.dtype in (jnp.float32, jnp.bfloat16) else q.astype(jnp.float32)


def _sm_scale(sm_scale, head_dim: int) -> np.float32:
    return np.float32((1.0 / head_dim**0.5) if sm_scale is None else sm_scale)


def _append_call(target: str, planes: list, n_fixed: int):
    return jax.ffi.ffi_call(
        target,
        tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in planes),
        input_output_aliases={n_fixed + i: i for i in range(len(planes))},
        vmap_method="sequential",
    )


# -- ops -------------------------------------------------------------------------------------------


def _variant_options(window, soft_cap, sinks, q_heads: int):
    """The variant attributes and the sinks operand; ``None`` when every option is off."""
    if window is None and soft_cap is None and sinks is None:
        return None
    window, soft_cap, sinks = check_attention_variant(q_heads, window, soft_cap, sinks)
    sinks_in = jnp.zeros((0,), jnp.float32) if sinks is None else sinks
    attrs = {
        "window": np.int32(0 if window is None else window),
        "soft_cap": np.float32(0.0 if soft_cap is None else soft_cap),
    }
    return sinks_in, attrs


def _paged_attention_call(target: str, q_in: jax.Array, view: PagedKVBatchLayerView, vectors, sm_scale,
                          window=None, soft_cap=None, sinks=None):
    """One paged attention handler: q, the tables, the layer, the int32 ``vectors``, [sinks,] the planes."""
    lay = view.layout
    options = _variant_options(window, soft_cap, sinks, q_in.shape[2])
    extra, attrs = (), {}
    if options is not None:  # the variant form; with every option off, the very call of before
        target += "_variants"
        extra, attrs = (options[0],), options[1]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q_in.shape, q_in.dtype), vmap_method="sequential")
    return call(
        q_in,
        _i32(view.block_tables),
        _layer(view.layer),
        *(_i32(x) for x in vectors),
        *extra,
        *_plane_list(view.planes, lay.profile),
        head_major=np.int32(lay.order is PlaneOrder.HEAD_MAJOR),
        sm_scale=_sm_scale(sm_scale, q_in.shape[-1]),
        no_splits=np.int32(_NO_SPLITS.get()),
        **_codec_attrs(lay.profile),
        **attrs,
    )


def _paged_append_call(target: str, view: PagedKVBatchLayerView, vectors, k, v) -> PagedKVBatchLayerView:
    """One paged append handler: the tables, the layer, the int32 ``vectors``, k, v, the planes (aliased)."""
    lay = view.layout
    planes = _plane_list(view.planes, lay.profile)
    kk, vv = _kv_inputs(k, v)
    call = _append_call(target, planes, n_fixed=4 + len(vectors))
    out = call(
        _i32(view.block_tables),
        _layer(view.layer),
        *(_i32(x) for x in vectors),
        kk,
        vv,
        *planes,
        head_major=np.int32(lay.order is PlaneOrder.HEAD_MAJOR),
        **_codec_attrs(lay.profile),
    )
    return view.replace(planes=dict(zip(lay.profile.plane_names(), out)))


def paged_append(
    view: PagedKVBatchLayerView, table_rows, positions, k, v, valid
) -> PagedKVBatchLayerView:
    """Quantize ``k, v (B, T, H, D)`` and write tokens ``t < valid[b]`` at ``positions[b] + t``.

    Returns the view with the updated planes; the planes are written in place when the caller's
    ``jax.jit`` donates them (otherwise XLA copies them first).
    """
    _require()
    return _paged_append_call("ninfer_kv_paged_append", view, (table_rows, positions, valid), k, v)


def paged_attention(q, view: PagedKVBatchLayerView, table_rows, positions, kv_lens, *, sm_scale=None, window=None,
                    soft_cap=None, sinks=None) -> jax.Array:
    """Causal GQA attention of ``q (B, T, Hq, D)`` over the paged view; ``(B, T, Hq, D)`` in q's dtype.

    ``sm_scale`` (default ``1 / sqrt(D)``), ``window`` (int >= 1: query position p sees keys
    ``j > p - window``) and ``soft_cap`` (float > 0: scores become ``soft_cap * tanh(s / soft_cap)``)
    are static Python numbers: they become attributes of the custom call.  ``sinks`` (float32
    ``(Hq,)``, may be traced) adds ``exp(sinks[hq] - max)`` to query head hq's denominator.
    """
    _require()
    out = _paged_attention_call("ninfer_kv_paged_attention", _query(q), view, (table_rows, positions, kv_lens),
                                sm_scale, window, soft_cap, sinks)
    return out.astype(jnp.asarray(q).dtype)


def paged_append_ragged(view: PagedKVBatchLayerView, table_rows, positions, k, v, query_starts) -> PagedKVBatchLayerView:
    """:func:`paged_append` of a ragged batch: ``k, v (N, H, D)`` hold the tokens of ``R`` rows one
    after another, row ``r`` tokens ``[query_starts[r], query_starts[r + 1])`` (``ninfer_kv.ops``
    has the rules); one pass over the tokens, no padding to a rectangle."""
    _require()
    k, v = jnp.asarray(k), jnp.asarray(v)
    return _paged_append_call("ninfer_kv_paged_append_ragged", view, (table_rows, positions, query_starts),
                              k[None], v[None])


def paged_attention_ragged(q, view: PagedKVBatchLayerView, table_rows, positions, kv_lens, query_starts, *,
                           sm_scale=None, window=None, soft_cap=None, sinks=None) -> jax.Array:
    """:func:`paged_attention` of a ragged batch: ``q (N, Hq, D)`` holds the queries of ``R`` rows one
    after another (see :func:`paged_append_ragged`); ``(N, Hq, D)`` in q's dtype, zeros for tokens
    of no row.  Each row's queries are blocked as the rectangular form blocks a row of that length.
    ``window``, ``soft_cap`` and ``sinks`` as in :func:`paged_attention`."""
    _require()
    out = _paged_attention_call("ninfer_kv_paged_attention_ragged", _query(q)[None], view,
                                (table_rows, positions, kv_lens, query_starts), sm_scale, window, soft_cap, sinks)
    return out[0].astype(jnp.asarray(q).dtype)


def cyclic_append(view: CyclicKVCacheLayerView, rows, positions, k, v, valid) -> CyclicKVCacheLayerView:
    """Write tokens ``t < valid[b]`` of row ``rows[b]`` at ring slots ``(positions[b] + t) mod slots``."""
    _require()
    lay = view.layout
    planes = _plane_list(view.planes, lay.profile)
    kk, vv = _kv_inputs(k, v)
    call = _append_call("ninfer_kv_cyclic_append", planes, n_fixed=6)
    out = call(
        _i32(rows),
        _i32(positions),
        _i32(valid),
        _layer(view.layer),
        kk,
        vv,
        *planes,
        **_codec_attrs(lay.profile),
    )
    return view.replace(planes=dict(zip(lay.profile.plane_names(), out)))


def cyclic_attention(q, view: CyclicKVCacheLayerView, rows, positions, kv_lens, *, sm_scale=None) -> jax.Array:
    """Windowed GQA attention over ring buffers; ``(B, T, Hq, D)`` in q's dtype (static ``sm_scale``)."""
    _require()
    lay = view.layout
    q_in = _query(q)
    call = jax.ffi.ffi_call(
        "ninfer_kv_cyclic_attention", jax.ShapeDtypeStruct(q_in.shape, q_in.dtype), vmap_method="sequential"
    )
    out = call(
        q_in,
        _i32(rows),
        _i32(positions),
        _i32(kv_lens),
        _layer(view.layer),
        *_plane_list(view.planes, lay.profile),
        window=np.int32(lay.window),
        sm_scale=_sm_scale(sm_scale, q_in.shape[-1]),
        no_splits=np.int32(_NO_SPLITS.get()),
        **_codec_attrs(lay.profile),
    )
    return out.astype(jnp.asarray(q).dtype)
