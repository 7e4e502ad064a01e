"""Public ops over paged and cyclic KV views.

Every op validates its inputs on the host (:mod:`ninfer_kv.ops.validation`: static checks always,
value checks when the inputs are concrete) and then calls one implementation chosen by ``impl``
(:mod:`ninfer_kv.ops.dispatch`):

* ``"auto"`` (default) — Pallas on GPU; the C++ XLA FFI kernels on CPU, falling back to the
  reference with a warning (once) when the FFI library is not built;
* ``"pallas"`` — ``pallas_kernels`` (Pallas interpret mode on a CPU backend);
* ``"ffi"`` — :mod:`ninfer_kv.ffi_ops` (error with rebuild instructions when it is not built);
* ``"reference"`` — :mod:`ninfer_kv.ops.reference` (gather-based jnp; for tests).

Semantics (identical for every implementation):

* :func:`paged_append` — row ``b`` writes tokens ``t < valid[b]`` of ``k, v (B, T, H, D)`` at
  logical positions ``positions[b] + t`` of table row ``table_rows[b]``: block ``pos >> 6``,
  column ``pos & 63``, quantized per the profile.  Nothing else changes.
* :func:`paged_attention` — query ``t`` of row ``b`` sits at ``positions[b] + t``; key ``j`` is
  visible iff ``j <= positions[b] + t and j < kv_lens[b]``; query head ``hq`` reads KV head
  ``hq // (Hq // H)``; a query with no visible key returns zeros.
* :func:`cyclic_append` / :func:`cyclic_attention` — the same over per-row ring buffers: key ``j``
  lives in slot ``j mod slots`` and is visible iff ``positions[b] + t - window < j <= positions[b] + t``
  and ``j < kv_lens[b]``.

Appends write in place when the caller's ``jax.jit`` donates the planes (the implementations alias
planes input -> output); an eager call returns new planes.  Page IDs, table rows, positions,
lengths and the layer index are array data, never part of a graph key.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..page_copy import copy_page_columns
from ..views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView, PagedKVLayerView
from . import validation
from .dispatch import (
    ImplFallbackWarning,
    ImplUnavailableError,
    OpImpl,
    available_impls,
    override_impls,
    register_impl,
    registered_impls,
    resolve_impl,
)
from .page_runs import gather_page_runs, scatter_page_runs
from .reference import (
    cyclic_append_reference,
    cyclic_attention_reference,
    paged_append_reference,
    paged_attention_reference,
)

__all__ = [
    "paged_append",
    "paged_attention",
    "cyclic_append",
    "cyclic_attention",
    "copy_page_columns",
    "gather_page_runs",
    "scatter_page_runs",
    "PagedKVBatchLayerView",
    "PagedKVLayerView",
    "CyclicKVCacheLayerView",
    "CyclicKVLayout",
    "resolve_impl",
    "available_impls",
    "registered_impls",
    "register_impl",
    "override_impls",
    "OpImpl",
    "ImplUnavailableError",
    "ImplFallbackWarning",
    "paged_append_reference",
    "paged_attention_reference",
    "cyclic_append_reference",
    "cyclic_attention_reference",
]


def _single_as_batch(view: PagedKVLayerView, table_rows, batch: int):
    """A one-sequence view as a batch view with ``table_rows = zeros((B,))``."""
    view.check()
    if table_rows is not None:
        validation.check_int_vector("table_rows", table_rows, batch)
        vals = validation.host_values(table_rows)
        if vals is not None and vals.any():
            i = int(vals.nonzero()[0][0])
            raise ValueError(
                f"table_rows[{i}]={int(vals[i])} is out of range; a PagedKVLayerView has one table row, "
                f"so table_rows must be None or zeros"
            )
    return view.as_batch(), jnp.zeros((batch,), jnp.int32)


def paged_append(view, table_rows, positions, k, v, valid, *, impl: str = "auto"):
    """Append ``k, v (B, T, H, D)`` to a paged view; returns the view with the new planes.

    Args:
      view: a :class:`PagedKVBatchLayerView`, or a :class:`PagedKVLayerView` (one sequence; then
        ``table_rows`` may be ``None`` and every batch row uses the view's single table row).
      table_rows: int32 ``(B,)`` block-table row of each batch row, in ``[0, C)``.
      positions: int32 ``(B,)`` logical position of token 0 of each row, ``>= 0``.
      k, v: ``(B, T, H, D)`` float32 or bfloat16; ``H``, ``D`` as in the view's layout.
      valid: int32 ``(B,)`` tokens to write per row, in ``[0, T]``; ``positions + valid <= L * 64``.
      impl: ``"auto"``, ``"pallas"``, ``"ffi"``, ``"reference"`` or a registered name.

    Returns:
      The same kind of view as ``view`` with updated planes (donate the planes under ``jax.jit``
      for an in-place write).
    """
    if isinstance(view, PagedKVLayerView):
        _require_shape(k, "k")
        batch_view, rows = _single_as_batch(view, table_rows, k.shape[0])
        out = paged_append(batch_view, rows, positions, k, v, valid, impl=impl)
        return PagedKVLayerView(out.planes, view.block_table, view.layer, view.layout, validate=False)
    validation.check_paged_append(view, table_rows, positions, k, v, valid)
    fn = resolve_impl(impl).paged_append
    return fn(view, jnp.asarray(table_rows), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid))


def paged_attention(q, view, table_rows, positions, kv_lens, *, sm_scale: float | None = None, impl: str = "auto"):
    """Causal paged attention of ``q (B, T, Hq, D)`` over a paged view; returns ``(B, T, Hq, D)``.

    Args:
      q: float32 or bfloat16 queries; ``Hq`` a multiple of the view's ``H`` (GQA).
      view: a :class:`PagedKVBatchLayerView` or a :class:`PagedKVLayerView` (see
        :func:`paged_append`).
      table_rows: int32 ``(B,)`` in ``[0, C)``.
      positions: int32 ``(B,)`` position of query 0 of each row, ``>= 0``.
      kv_lens: int32 ``(B,)`` readable keys of each row, in ``[0, L * 64]``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      impl: implementation name (see the module docstring).

    Returns:
      The attention output in ``q.dtype``; zeros for a query with no visible key.
    """
    if isinstance(view, PagedKVLayerView):
        _require_shape(q, "q")
        batch_view, rows = _single_as_batch(view, table_rows, q.shape[0])
        return paged_attention(q, batch_view, rows, positions, kv_lens, sm_scale=sm_scale, impl=impl)
    validation.check_paged_attention(q, view, table_rows, positions, kv_lens, sm_scale)
    fn = resolve_impl(impl).paged_attention
    return fn(jnp.asarray(q), view, jnp.asarray(table_rows), jnp.asarray(positions), jnp.asarray(kv_lens), sm_scale=sm_scale)


def cyclic_append(view, rows, positions, k, v, valid, *, impl: str = "auto"):
    """Append ``k, v (B, T, H, D)`` to per-row ring buffers; returns the updated view.

    Token ``t < valid[b]`` of row ``rows[b]`` goes to slot ``(positions[b] + t) mod slots``; when a
    row writes more than ``slots`` tokens only the last ``slots`` survive.
    """
    validation.check_cyclic_append(view, rows, positions, k, v, valid)
    fn = resolve_impl(impl).cyclic_append
    return fn(view, jnp.asarray(rows), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid))


def cyclic_attention(q, view, rows, positions, kv_lens, *, sm_scale: float | None = None, impl: str = "auto"):
    """Windowed attention over ring buffers; key ``j`` visible iff ``p - window < j <= p`` and ``j < kv_lens``.

    ``T`` may be at most ``slots - window + 1`` (the ring must still hold the oldest key of query 0).
    """
    validation.check_cyclic_attention(q, view, rows, positions, kv_lens, sm_scale)
    fn = resolve_impl(impl).cyclic_attention
    return fn(jnp.asarray(q), view, jnp.asarray(rows), jnp.asarray(positions), jnp.asarray(kv_lens), sm_scale=sm_scale)


def _require_shape(x, name: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) != 4:
        raise ValueError(f"{name} must be a 4-D array, got {getattr(x, 'shape', type(x).__name__)}")
