"""Public ops over paged and cyclic KV views.

Every op validates its inputs on the host (:mod:`ninfer_kv.ops.validation`: static checks always,
value checks when the inputs are concrete) and then calls one implementation chosen by ``impl``
(:mod:`ninfer_kv.ops.dispatch`):

* ``"auto"`` (default) — Pallas on GPU; the C++ XLA FFI kernels on CPU, falling back to the
  reference with a warning (once) when the FFI library is not built;
* ``"pallas"`` — ``pallas_kernels`` (Pallas interpret mode on a CPU backend);
* ``"ffi"`` — :mod:`ninfer_kv.ops.ffi` (error with rebuild instructions when it is not built);
* ``"reference"`` — :mod:`ninfer_kv.ops.reference` (gather-based jnp; for tests).

Semantics (identical for every implementation):

* :func:`paged_append` — batch row ``b`` writes tokens ``t < valid[b]`` of ``k, v (B, T, H, D)`` at
  logical positions ``positions[b] + t`` of execution row ``table_rows[b]`` (a block-table row):
  block ``pos >> 6``, column ``pos & 63``, quantized per the profile.  Nothing else changes.
* :func:`paged_attention` — query ``t`` of batch row ``b`` sits at ``positions[b] + t``; key ``j`` is
  visible iff ``j <= positions[b] + t and j < kv_lens[b]``; query head ``hq`` reads KV head
  ``hq // (Hq // H)``; a query with no visible key returns zeros.
* :func:`paged_append_ragged` / :func:`paged_attention_ragged` — the same over a *ragged* batch:
  the tokens of ``R`` batch rows lie one after another on one axis of ``N`` tokens, row ``r`` owning
  ``[query_starts[r], query_starts[r + 1])`` (its token ``t`` at ``positions[r] + t``), so decodes
  of one token sit beside prefill chunks with no padding to a rectangle; tokens of no row are
  padding (nothing written, zeros returned).  A row's result is its rectangular result.
* :func:`cyclic_append` / :func:`cyclic_attention` — the same over ring buffers (``rows[b]``, one
  per execution row): key ``j`` lives in ring slot ``j mod slots`` and is visible iff
  ``positions[b] + t - window < j <= positions[b] + t`` and ``j < kv_lens[b]``.

Index vectors (``table_rows``/``rows``, ``positions``, ``valid``, ``kv_lens``) accept any integer
array-like — numpy arrays of any integer dtype, Python lists, ``jax`` arrays — and are converted to
int32 (:mod:`ninfer_kv.ops.indices`): a concrete value that does not fit in int32 is a
``ValueError``, a non-integer dtype a ``TypeError``.

Out-of-range indices.  With concrete inputs every range is checked before anything runs
(:mod:`ninfer_kv.ops.validation`), including every block-table entry the op touches: the blocks
of ``[positions, positions + valid)`` for an append and of ``[0, kv_lens)`` for attention must map
to physical pages in ``[0, N)``, else a ``ValueError`` names the table row, the batch row, the
block, the value and the range.  Under ``jax.jit`` nothing can be checked and every implementation
behaves the same way, without touching memory outside the planes:

* a ``table_rows[b]`` (or cyclic ``rows[b]``) outside ``[0, C)`` makes row ``b`` inert: its append
  writes nothing and its attention returns zeros;
* a table entry outside ``[0, N)`` (negative included) drops the appended tokens of that block and
  makes every key of that block invisible to attention;
* logical positions outside ``[0, L * 64)`` are dropped by appends; attention reads
  ``clip(kv_lens, 0, L * 64)`` keys and a query at a negative position sees no key; ``valid`` is
  clipped to ``[0, T]``.

Appends write in place when the caller's ``jax.jit`` donates the planes (the implementations alias
planes input -> output); an eager call returns new planes.  Page IDs, table rows, positions,
lengths and the layer index are array data, never part of a graph key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .page_copy import copy_page_columns
from .views import CyclicKVCacheLayerView, PagedKVBatchLayerView, PagedKVLayerView
from . import validation
from . import dispatch  # noqa: F401  (registers the built-in backends in ninfer_kv.ops.registry)
from .registry import (
    ImplFallbackWarning,
    ImplUnavailableError,
    OpImpl,
    available_impls,
    override_impls,
    register_backend,
    register_impl,
    register_op,
    registered_impls,
    registered_ops,
    resolve_impl,
)
from .page_runs import gather_page_runs, scatter_page_runs
from .ragged import append_by_token, attention_by_token
from .reference import (
    cyclic_append_reference,
    cyclic_attention_reference,
    paged_append_reference,
    paged_append_ragged_reference,
    paged_attention_ragged_reference,
    paged_attention_reference,
)

__all__ = [
    "paged_append",
    "paged_attention",
    "paged_append_ragged",
    "paged_attention_ragged",
    "cyclic_append",
    "cyclic_attention",
    "copy_page_columns",
    "gather_page_runs",
    "scatter_page_runs",
    "resolve_impl",
    "available_impls",
    "registered_impls",
    "register_impl",
    "register_backend",
    "register_op",
    "registered_ops",
    "override_impls",
    "OpImpl",
    "ImplUnavailableError",
    "ImplFallbackWarning",
    "paged_append_reference",
    "paged_attention_reference",
    "paged_append_ragged_reference",
    "paged_attention_ragged_reference",
    "cyclic_append_reference",
    "cyclic_attention_reference",
]


def _single_as_batch(view: PagedKVLayerView, table_rows: ArrayLike | None, batch: int):
    """A one-sequence view as a batch view with ``table_rows = zeros((B,))``."""
    view.check()
    if table_rows is not None:
        table_rows = validation.check_int_vector("table_rows", table_rows, batch)
        vals = validation.host_values(table_rows)
        if vals is not None and vals.any():
            i = int(vals.nonzero()[0][0])
            raise ValueError(
                f"table_rows[{i}]={int(vals[i])} is out of range; a PagedKVLayerView has one table row, "
                f"so table_rows must be None or zeros"
            )
    return view.as_batch(), jnp.zeros((batch,), jnp.int32)


def paged_append(
    view: PagedKVBatchLayerView | PagedKVLayerView,
    table_rows: ArrayLike | None,
    positions: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    valid: ArrayLike,
    *,
    impl: str = "auto",
) -> PagedKVBatchLayerView | PagedKVLayerView:
    """Append ``k, v (B, T, H, D)`` to a paged view; returns the view with the new planes.

    Args:
      view: a :class:`PagedKVBatchLayerView`, or a :class:`PagedKVLayerView` (one sequence; then
        ``table_rows`` may be ``None`` and every batch row uses the view's single table row).
      table_rows: integer ``(B,)`` block-table row of each batch row, in ``[0, C)``.
      positions: integer ``(B,)`` logical position of token 0 of each row, ``>= 0``.
      k, v: ``(B, T, H, D)`` float32 or bfloat16; ``H``, ``D`` as in the view's layout.
      valid: integer ``(B,)`` tokens to write per row, in ``[0, T]``; ``positions + valid <= L * 64``.
      impl: ``"auto"`` or a registered name (:func:`ninfer_kv.ops.registry.impl_choices`).

    Integer vectors may be any integer array-like (converted to int32).  With concrete inputs the
    table entries of the blocks of ``[positions, positions + valid)`` must lie in ``[0, N)``;
    under ``jax.jit`` an out-of-range row makes the row inert and an out-of-range entry drops the
    tokens of its block (see the module docstring).

    Returns:
      The same kind of view as ``view`` with updated planes (donate the planes under ``jax.jit``
      for an in-place write).

    Raises:
      ValueError: a bad shape, an out-of-range value or table entry (concrete inputs), an index
        that does not fit in int32.
      TypeError: a wrong kind of view or a non-integer index dtype.
    """
    if isinstance(view, PagedKVLayerView):
        _require_shape(k, "k")
        batch_view, rows = _single_as_batch(view, table_rows, k.shape[0])
        out = paged_append(batch_view, rows, positions, k, v, valid, impl=impl)
        return PagedKVLayerView(out.planes, view.block_table, view.layer, view.layout, validate=False)
    table_rows, positions, valid = validation.check_paged_append(view, table_rows, positions, k, v, valid)
    fn = resolve_impl(impl).paged_append
    return fn(view, table_rows, positions, jnp.asarray(k), jnp.asarray(v), valid)


def paged_attention(
    q: ArrayLike,
    view: PagedKVBatchLayerView | PagedKVLayerView,
    table_rows: ArrayLike | None,
    positions: ArrayLike,
    kv_lens: ArrayLike,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Causal paged attention of ``q (B, T, Hq, D)`` over a paged view; returns ``(B, T, Hq, D)``.

    Args:
      q: float32 or bfloat16 queries; ``Hq`` a multiple of the view's ``H`` (GQA).
      view: a :class:`PagedKVBatchLayerView` or a :class:`PagedKVLayerView` (see
        :func:`paged_append`).
      table_rows: integer ``(B,)`` in ``[0, C)``.
      positions: integer ``(B,)`` position of query 0 of each row, ``>= 0``.
      kv_lens: integer ``(B,)`` readable keys of each row, in ``[0, L * 64]``.
      sm_scale: score scale (default ``1 / sqrt(D)``).
      window: ``None`` (full causal attention) or a static int ``>= 1``: a query at position ``p``
        sees only keys ``j > p - window`` (a sliding window of the last ``window`` positions);
        pages wholly before a query block's window are not read.
      soft_cap: ``None`` or a static real ``> 0``: scores become ``soft_cap * tanh(s / soft_cap)``
        before the softmax (Gemma 2's attention logit soft cap).
      sinks: ``None`` or a float ``(Hq,)`` array: one learned logit per query head that joins the
        softmax's denominator with a zero value (gpt-oss's attention sinks).
      impl: implementation name (see the module docstring).

    With concrete inputs the table entries of the blocks of ``[0, kv_lens)`` must lie in
    ``[0, N)``; under ``jax.jit`` an out-of-range row returns zeros and the keys of an
    out-of-range entry are invisible (see the module docstring).

    Returns:
      The attention output in ``q.dtype``; zeros for a query with no visible key.

    Raises:
      ValueError, TypeError: as :func:`paged_append`.
    """
    if isinstance(view, PagedKVLayerView):
        _require_shape(q, "q")
        batch_view, rows = _single_as_batch(view, table_rows, q.shape[0])
        return paged_attention(q, batch_view, rows, positions, kv_lens, sm_scale=sm_scale, window=window,
                               soft_cap=soft_cap, sinks=sinks, impl=impl)
    table_rows, positions, kv_lens = validation.check_paged_attention(q, view, table_rows, positions, kv_lens, sm_scale)
    variant = _variant(q.shape[2], window, soft_cap, sinks)
    fn = resolve_impl(impl).paged_attention
    return fn(jnp.asarray(q), view, table_rows, positions, kv_lens, sm_scale=sm_scale, **variant)


def paged_append_ragged(
    view: PagedKVBatchLayerView,
    table_rows: ArrayLike,
    positions: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    query_starts: ArrayLike,
    *,
    impl: str = "auto",
) -> PagedKVBatchLayerView:
    """Append the tokens ``k, v (N, H, D)`` of ``R`` rows; returns the view with the new planes.

    Args:
      view: a :class:`PagedKVBatchLayerView`.
      table_rows: integer ``(R,)`` block-table row of each row, in ``[0, C)``.
      positions: integer ``(R,)`` logical position of each row's first token, ``>= 0``.
      k, v: ``(N, H, D)`` float32 or bfloat16: row ``r``'s tokens are ``[query_starts[r],
        query_starts[r + 1])``.
      query_starts: integer ``(R + 1,)``, non-decreasing, in ``[0, N]``; tokens outside
        ``[query_starts[0], query_starts[R])`` are padding and are not written.
      impl: as :func:`paged_append`; a backend without a native ragged kernel runs its
        rectangular append over one token per row (:mod:`ninfer_kv.ops.ragged`).

    With concrete inputs every range and every table entry the writes touch is checked as for
    :func:`paged_append` (a row's length plays ``valid``); under ``jax.jit`` ``query_starts`` is
    clamped into ``[0, N]`` and made non-decreasing, and the rules of the module docstring apply.
    """
    table_rows, positions, query_starts = validation.check_paged_append_ragged(
        view, table_rows, positions, k, v, query_starts)
    backend = resolve_impl(impl)
    fn = backend.paged_append_ragged or append_by_token(backend.paged_append)
    return fn(view, table_rows, positions, jnp.asarray(k), jnp.asarray(v), query_starts)


def paged_attention_ragged(
    q: ArrayLike,
    view: PagedKVBatchLayerView,
    table_rows: ArrayLike,
    positions: ArrayLike,
    kv_lens: ArrayLike,
    query_starts: ArrayLike,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Causal paged attention of the queries ``q (N, Hq, D)`` of ``R`` rows; returns ``(N, Hq, D)``.

    Row ``r``'s queries are tokens ``[query_starts[r], query_starts[r + 1])`` at positions
    ``positions[r] + t``, reading ``kv_lens[r]`` keys of table row ``table_rows[r]`` (the visibility
    rule of :func:`paged_attention`, ``window``, ``soft_cap`` and ``sinks`` included); padding tokens
    return zeros.  Arguments and checks as :func:`paged_append_ragged` and :func:`paged_attention`.
    """
    table_rows, positions, kv_lens, query_starts = validation.check_paged_attention_ragged(
        q, view, table_rows, positions, kv_lens, query_starts, sm_scale)
    variant = _variant(q.shape[1], window, soft_cap, sinks)
    backend = resolve_impl(impl)
    fn = backend.paged_attention_ragged or attention_by_token(backend.paged_attention)
    return fn(jnp.asarray(q), view, table_rows, positions, kv_lens, query_starts, sm_scale=sm_scale, **variant)


def _variant(q_heads: int, window, soft_cap, sinks) -> dict:
    """The attention variant's checked options, only those that are set: a backend is called with
    exactly the arguments of full attention when none is (so a backend that predates them serves
    full attention unchanged)."""
    window, soft_cap, sinks = validation.check_attention_variant(q_heads, window, soft_cap, sinks)
    return {k: v for k, v in (("window", window), ("soft_cap", soft_cap), ("sinks", sinks)) if v is not None}


def cyclic_append(
    view: CyclicKVCacheLayerView,
    rows: ArrayLike,
    positions: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    valid: ArrayLike,
    *,
    impl: str = "auto",
) -> CyclicKVCacheLayerView:
    """Append ``k, v (B, T, H, D)`` to per-row ring buffers; returns the updated view.

    Token ``t < valid[b]`` of row ``rows[b]`` goes to slot ``(positions[b] + t) mod slots``; when a
    row writes more than ``slots`` tokens only the last ``slots`` survive.  ``rows``, ``positions``
    and ``valid`` are integer ``(B,)`` array-likes; under ``jax.jit`` a row outside ``[0, rows)``
    writes nothing and negative positions are dropped.
    """
    rows, positions, valid = validation.check_cyclic_append(view, rows, positions, k, v, valid)
    fn = resolve_impl(impl).cyclic_append
    return fn(view, rows, positions, jnp.asarray(k), jnp.asarray(v), valid)


def cyclic_attention(
    q: ArrayLike,
    view: CyclicKVCacheLayerView,
    rows: ArrayLike,
    positions: ArrayLike,
    kv_lens: ArrayLike,
    *,
    sm_scale: float | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Windowed attention over ring buffers; key ``j`` visible iff ``p - window < j <= p`` and ``j < kv_lens``.

    ``T`` may be at most ``slots - window + 1`` (the ring must still hold the oldest key of query 0).
    Under ``jax.jit`` a row outside ``[0, rows)`` returns zeros and a query at a negative position
    sees no key.
    """
    rows, positions, kv_lens = validation.check_cyclic_attention(q, view, rows, positions, kv_lens, sm_scale)
    fn = resolve_impl(impl).cyclic_attention
    return fn(jnp.asarray(q), view, rows, positions, kv_lens, sm_scale=sm_scale)


def _require_shape(x, name: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) != 4:
        raise ValueError(f"{name} must be a 4-D array, got {getattr(x, 'shape', type(x).__name__)}")
