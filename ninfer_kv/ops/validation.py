"""Validation of op inputs on the host (runs before any implementation is called).

Two tiers of checks:

* **Static** (always, also under ``jax.jit`` where inputs are tracers): view type, plane keys,
  shapes and dtypes against the view's layout, block-table shape/dtype, k/v/q dtypes and shapes
  against the layout's ``H`` and ``D``, ``Hq % H == 0``, ``T >= 1``, ``(B,)`` integer row/position/
  length vectors (any integer dtype; converted to int32, see :mod:`ninfer_kv.ops.indices`),
  ``sm_scale``.
* **Values** (only for concrete inputs, i.e. outside a trace): ``table_rows`` in ``[0, C)``,
  ``positions >= 0``, ``valid`` in ``[0, T]``, ``positions + valid <= L * 64``, ``kv_lens`` in
  ``[0, L * 64]``; every block-table entry the op will touch — the blocks of
  ``[positions, positions + valid)`` for an append, of ``[0, kv_lens)`` for attention — is a
  physical page in ``[0, N)``; for cyclic views ``rows`` in ``[0, rows)``; the layer index in range.

Every failure raises ``ValueError`` (or ``TypeError`` for a wrong kind of object or a non-integer
index dtype) whose message names the argument, the bad value (with its index for vectors) and the
allowed range.  Nothing is modified.  Under ``jax.jit`` the value checks cannot run; the
implementations then follow the out-of-range rules of :mod:`ninfer_kv.ops` (inert rows, dropped
writes, invisible keys) and never touch memory outside the planes.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import chex
import jax
import jax.numpy as jnp
import numpy as np

from .views import CyclicKVCacheLayerView, PagedKVBatchLayerView
from .indices import int32_vector
from ..planning import INT32_MAX

__all__ = [
    "is_concrete",
    "check_paged_view",
    "check_cyclic_view",
    "check_paged_append",
    "check_paged_attention",
    "check_paged_append_ragged",
    "check_paged_attention_ragged",
    "check_cyclic_append",
    "check_cyclic_attention",
    "check_sm_scale",
    "check_int_vector",
    "check_table_entries",
    "host_values",
]

KV_DTYPES = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16))
_KV_DTYPE_NAMES = "float32 or bfloat16"


def is_concrete(x) -> bool:
    """True when ``x`` holds values on the host side of a trace (not a ``jax`` tracer)."""
    return not isinstance(x, jax.core.Tracer)


def _chex(assertion, message: str) -> None:
    """Run a chex assertion; turn its ``AssertionError`` into a ``ValueError`` with ``message``."""
    try:
        assertion()
    except AssertionError as e:
        raise ValueError(f"{message} [{e}]") from None


def _require_array(name: str, x) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


# -- views ---------------------------------------------------------------------------------------


def check_paged_view(view) -> None:
    """A :class:`PagedKVBatchLayerView` whose planes, block tables and layer match its layout."""
    if not isinstance(view, PagedKVBatchLayerView):
        raise TypeError(
            f"view must be a PagedKVBatchLayerView (or a PagedKVLayerView for one sequence), got {type(view).__name__}"
        )
    view.check()


def check_cyclic_view(view) -> None:
    """A :class:`CyclicKVCacheLayerView` whose planes and layer match its layout."""
    if not isinstance(view, CyclicKVCacheLayerView):
        raise TypeError(f"view must be a CyclicKVCacheLayerView, got {type(view).__name__}")
    view.check()


# -- tensors -------------------------------------------------------------------------------------


def _check_kv(k, v, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """k, v: (B, T, H, D), float32 or bfloat16, one shape and dtype. Returns (B, T)."""
    for name, x in (("k", k), ("v", v)):
        _require_array(name, x)
        if np.dtype(x.dtype) not in KV_DTYPES:
            raise ValueError(f"{name} has dtype {np.dtype(x.dtype).name}; allowed: {_KV_DTYPE_NAMES}")
        _chex(lambda x=x: chex.assert_rank(x, 4), f"{name} must be (B, T, H, D), got shape {tuple(x.shape)}")
    _chex(lambda: chex.assert_equal_shape((k, v)), f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if np.dtype(k.dtype) != np.dtype(v.dtype):
        raise ValueError(f"k and v dtypes differ: {np.dtype(k.dtype).name} vs {np.dtype(v.dtype).name}")
    b, t, h, d = k.shape
    if b < 1:
        raise ValueError(f"k has batch B={b}; it must be >= 1")
    if t < 1:
        raise ValueError(f"k has T={t} tokens per row; T must be >= 1")
    if h != num_kv_heads:
        raise ValueError(f"k has H={h} heads; the view's layout has num_kv_heads={num_kv_heads}")
    if d != head_dim:
        raise ValueError(f"k has head dim D={d}; the view's layout has head_dim={head_dim}")
    return b, t


def _check_q(q, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """q: (B, T, Hq, D) float32 or bfloat16 with Hq a multiple of H. Returns (B, T)."""
    _require_array("q", q)
    if np.dtype(q.dtype) not in KV_DTYPES:
        raise ValueError(f"q has dtype {np.dtype(q.dtype).name}; allowed: {_KV_DTYPE_NAMES}")
    _chex(lambda: chex.assert_rank(q, 4), f"q must be (B, T, Hq, D), got shape {tuple(q.shape)}")
    b, t, hq, d = q.shape
    if b < 1:
        raise ValueError(f"q has batch B={b}; it must be >= 1")
    if t < 1:
        raise ValueError(f"q has T={t} queries per row; T must be >= 1")
    if d != head_dim:
        raise ValueError(f"q has head dim D={d}; the view's layout has head_dim={head_dim}")
    if hq < 1 or hq % num_kv_heads:
        raise ValueError(
            f"q has Hq={hq} query heads, which is not a positive multiple of the H={num_kv_heads} KV heads (GQA needs Hq % H == 0)"
        )
    return b, t


def check_int_vector(name: str, x, batch: int) -> jax.Array:
    """An integer ``(B,)`` array-like as int32 (``TypeError`` for a non-integer dtype)."""
    return int32_vector(name, x, batch)


def host_values(x) -> np.ndarray | None:
    """``x`` as a numpy array when it is concrete, else ``None`` (value checks are skipped)."""
    return np.asarray(x) if is_concrete(x) else None


def _first_bad(name: str, values: np.ndarray, bad: np.ndarray, allowed: str) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}]={int(values[i])} is out of range; allowed: {allowed}")


def _check_position_span(pos: np.ndarray, t: int) -> None:
    """Positions ``positions[b] + t`` of a call's ``T`` tokens must be int32 values."""
    _first_bad("positions", pos, pos.astype(np.int64) + (t - 1) > INT32_MAX, f"<= 2**31 - T = {INT32_MAX - t + 1} (T={t})")


def check_sm_scale(sm_scale) -> None:
    """``None`` (meaning ``1/sqrt(D)``) or a finite real number > 0."""
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, Real):
        raise TypeError(f"sm_scale must be None or a Python/numpy real number, got {type(sm_scale).__name__}")
    if not math.isfinite(float(sm_scale)) or float(sm_scale) <= 0:
        raise ValueError(f"sm_scale={sm_scale!r} is invalid; it must be a finite number > 0 (or None for 1/sqrt(D))")


def check_attention_variant(q_heads: int, window=None, soft_cap=None, sinks=None):
    """The attention variant's options: ``window`` ``None`` or a Python/numpy int >= 1 (static),
    ``soft_cap`` ``None`` or a finite real > 0 (static), ``sinks`` ``None`` or a float array
    ``(Hq,)`` (finite where concrete).  Returns ``(window, soft_cap, sinks)`` as ``int``,
    ``float`` and a float32 array (or ``None``)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, Integral):
            raise TypeError(f"window must be None or a Python/numpy int (static), got {type(window).__name__}")
        if int(window) < 1:
            raise ValueError(f"window={int(window)} is invalid; it must be >= 1 (or None for full attention)")
        window = int(window)
    if soft_cap is not None:
        if isinstance(soft_cap, bool) or not isinstance(soft_cap, Real):
            raise TypeError(f"soft_cap must be None or a Python/numpy real number (static), got {type(soft_cap).__name__}")
        if not math.isfinite(float(soft_cap)) or float(soft_cap) <= 0:
            raise ValueError(f"soft_cap={soft_cap!r} is invalid; it must be a finite number > 0 (or None)")
        soft_cap = float(soft_cap)
    if sinks is not None:
        _require_array("sinks", sinks)
        if tuple(sinks.shape) != (q_heads,):
            raise ValueError(f"sinks has shape {tuple(sinks.shape)}; it must be ({q_heads},): one logit per query head")
        if not np.issubdtype(np.dtype(sinks.dtype), np.floating) and np.dtype(sinks.dtype) != jnp.bfloat16:
            raise ValueError(f"sinks has dtype {np.dtype(sinks.dtype).name}; it must be a float array")
        vals = host_values(sinks)
        if vals is not None and not np.isfinite(vals).all():
            raise ValueError(f"sinks[{int(np.flatnonzero(~np.isfinite(vals))[0])}] is not finite")
        sinks = jnp.asarray(sinks, jnp.float32)
    return window, soft_cap, sinks


# -- paged ops -----------------------------------------------------------------------------------


def _check_table_rows(table_rows, max_concurrency: int) -> None:
    vals = host_values(table_rows)
    if vals is not None:
        _first_bad("table_rows", vals, (vals < 0) | (vals >= max_concurrency), f"[0, C={max_concurrency})")


def check_table_entries(view, table_rows, first, count, op: str) -> None:
    """Each batch row ``b`` touches logical blocks ``first[b] .. first[b] + count[b] - 1`` of
    table row ``table_rows[b]``; those entries must be physical pages in ``[0, N)``.

    Skipped unless the block table and the vectors are concrete (and already range-checked).
    """
    tables = host_values(view.block_tables)
    rows, lo, cnt = host_values(table_rows), host_values(first), host_values(count)
    if tables is None or rows is None or lo is None or cnt is None:
        return
    n = view.num_pages
    blk = np.arange(tables.shape[1])[None, :]
    lo = lo.astype(np.int64)[:, None]
    used = (blk >= lo) & (blk < lo + cnt.astype(np.int64)[:, None])  # (B, L)
    entries = tables[rows]
    bad = used & ((entries < 0) | (entries >= n))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        r = int(rows[b])
        span = f"blocks [{int(lo[b, 0])}, {int(lo[b, 0] + cnt[b])})"
        raise ValueError(
            f"block_tables[{r}, {j}] = {int(entries[b, j])} (table row {r} = table_rows[{b}], logical block {j}) "
            f"is not a physical page: {op} uses {span} of that row, whose entries must lie in [0, N={n})"
        )


def check_paged_append(view, table_rows, positions, k, v, valid) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checks an append's inputs; returns ``(table_rows, positions, valid)`` as int32 arrays."""
    check_paged_view(view)
    b, t = _check_kv(k, v, view.num_kv_heads, view.head_dim)
    table_rows, positions, valid = (
        check_int_vector(name, x, b) for name, x in (("table_rows", table_rows), ("positions", positions), ("valid", valid))
    )
    val = host_values(valid)
    if val is not None:
        _first_bad("valid", val, (val < 0) | (val > t), f"[0, T={t}]")
    _check_append_spans(view, table_rows, positions, val, "valid")
    return table_rows, positions, valid


def _check_append_spans(view, table_rows, positions, val, count_name: str) -> None:
    """Rows append ``val[b]`` tokens (range-checked; ``None`` when not concrete) from ``positions[b]``:
    the table rows, the positions, the capacity and every table entry the writes touch."""
    cap = view.logical_pages * view.page_size
    _check_table_rows(table_rows, view.max_concurrency)
    pos = host_values(positions)
    if pos is not None:
        _first_bad("positions", pos, pos < 0, ">= 0")
    if pos is not None and val is not None:
        end = pos.astype(np.int64) + val
        bad = end > cap
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"positions[{i}] + {count_name}[{i}] = {int(pos[i])} + {int(val[i])} = {int(end[i])} exceeds the "
                f"logical capacity L*P = {view.logical_pages}*{view.page_size} = {cap} tokens of a table row"
            )
        p = view.page_size
        first = pos // p
        last = np.where(val > 0, (end - 1) // p, first - 1)
        check_table_entries(view, table_rows, first, last - first + 1, "paged_append")


def check_paged_attention(q, view, table_rows, positions, kv_lens, sm_scale=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checks an attention call's inputs; returns ``(table_rows, positions, kv_lens)`` as int32 arrays."""
    check_paged_view(view)
    b, t = _check_q(q, view.num_kv_heads, view.head_dim)
    table_rows, positions, kv_lens = (
        check_int_vector(name, x, b)
        for name, x in (("table_rows", table_rows), ("positions", positions), ("kv_lens", kv_lens))
    )
    check_sm_scale(sm_scale)
    _check_attention_spans(view, table_rows, positions, kv_lens, t)
    return table_rows, positions, kv_lens


def _check_attention_spans(view, table_rows, positions, kv_lens, t: int) -> None:
    """Rows of at most ``t`` queries at ``positions`` reading ``kv_lens`` keys: the table rows, the
    positions, the lengths and every table entry the reads touch."""
    cap = view.logical_pages * view.page_size
    _check_table_rows(table_rows, view.max_concurrency)
    pos, lens = host_values(positions), host_values(kv_lens)
    if pos is not None:
        _first_bad("positions", pos, pos < 0, ">= 0")
        _check_position_span(pos, t)
    if lens is not None:
        _first_bad("kv_lens", lens, (lens < 0) | (lens > cap), f"[0, L*P={cap}]")
        blocks = -(-lens.astype(np.int64) // view.page_size)
        check_table_entries(view, table_rows, np.zeros_like(blocks), blocks, "paged_attention")


# -- ragged (ragged) forms -----------------------------------------------------------------------


def _check_ragged(name: str, x, rank_name: str) -> int:
    """A ragged token tensor ``(N, heads, D)`` (float32 or bfloat16); returns ``N``."""
    _require_array(name, x)
    if np.dtype(x.dtype) not in KV_DTYPES:
        raise ValueError(f"{name} has dtype {np.dtype(x.dtype).name}; allowed: {_KV_DTYPE_NAMES}")
    _chex(lambda: chex.assert_rank(x, 3), f"{name} must be the tokens of a ragged batch {rank_name}, got shape {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"{name} has N={x.shape[0]} tokens; N must be >= 1")
    return int(x.shape[0])


def _check_query_starts(query_starts, rows: int, tokens: int) -> tuple[jax.Array, np.ndarray | None]:
    """``query_starts`` int ``(R + 1,)``: non-decreasing, from ``>= 0`` up to ``<= N``.  Returns it as
    int32 and the row lengths (``None`` when not concrete)."""
    starts = check_int_vector("query_starts", query_starts, rows + 1)
    s = host_values(starts)
    if s is None:
        return starts, None
    s = s.astype(np.int64)
    _first_bad("query_starts", s, (s < 0) | (s > tokens), f"[0, N={tokens}] (N tokens in all)")
    drops = np.diff(s) < 0
    if drops.any():
        i = int(np.argmax(drops)) + 1
        raise ValueError(f"query_starts[{i}]={int(s[i])} is below query_starts[{i - 1}]={int(s[i - 1])}; "
                         f"query_starts must be non-decreasing (row r owns tokens [query_starts[r], query_starts[r + 1]))")
    return starts, np.diff(s)


def check_paged_append_ragged(view, table_rows, positions, k, v, query_starts):
    """Checks a ragged append's inputs (``k, v (N, H, D)``, ``R`` rows); returns ``(table_rows,
    positions, query_starts)`` as int32 arrays."""
    check_paged_view(view)
    n = _check_ragged("k", k, "(N, H, D)")
    _check_ragged("v", v, "(N, H, D)")
    _check_kv(k[None], v[None], view.num_kv_heads, view.head_dim)
    table_rows = _rows_vector("table_rows", table_rows)
    r = int(table_rows.shape[0])
    positions = check_int_vector("positions", positions, r)
    query_starts, lengths = _check_query_starts(query_starts, r, n)
    _check_append_spans(view, table_rows, positions, lengths, "row length")
    return table_rows, positions, query_starts


def check_paged_attention_ragged(q, view, table_rows, positions, kv_lens, query_starts, sm_scale=None):
    """Checks a ragged attention call's inputs (``q (N, Hq, D)``, ``R`` rows); returns ``(table_rows,
    positions, kv_lens, query_starts)`` as int32 arrays."""
    check_paged_view(view)
    n = _check_ragged("q", q, "(N, Hq, D)")
    _check_q(q[None], view.num_kv_heads, view.head_dim)
    table_rows = _rows_vector("table_rows", table_rows)
    r = int(table_rows.shape[0])
    positions = check_int_vector("positions", positions, r)
    kv_lens = check_int_vector("kv_lens", kv_lens, r)
    query_starts, lengths = _check_query_starts(query_starts, r, n)
    check_sm_scale(sm_scale)
    longest = int(lengths.max()) if lengths is not None and lengths.size else 1
    _check_attention_spans(view, table_rows, positions, kv_lens, max(longest, 1))
    return table_rows, positions, kv_lens, query_starts


def _rows_vector(name: str, x) -> jax.Array:
    """An integer vector of any length ``R >= 1`` as int32 (the rows of a ragged call)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        shape = np.shape(x)
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} must be an integer vector (R,) with R >= 1 rows, got shape {tuple(shape)}")
    return check_int_vector(name, x, int(shape[0]))


# -- cyclic ops ----------------------------------------------------------------------------------


def _check_cyclic_rows(rows, num_rows: int) -> None:
    vals = host_values(rows)
    if vals is not None:
        _first_bad("rows", vals, (vals < 0) | (vals >= num_rows), f"[0, rows={num_rows})")


def check_cyclic_append(view, rows, positions, k, v, valid) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checks a cyclic append's inputs; returns ``(rows, positions, valid)`` as int32 arrays."""
    check_cyclic_view(view)
    lay = view.layout
    b, t = _check_kv(k, v, lay.num_kv_heads, lay.head_dim)
    rows, positions, valid = (
        check_int_vector(name, x, b) for name, x in (("rows", rows), ("positions", positions), ("valid", valid))
    )
    _check_cyclic_rows(rows, lay.rows)
    pos, val = host_values(positions), host_values(valid)
    if pos is not None:
        _first_bad("positions", pos, pos < 0, ">= 0")
    if val is not None:
        _first_bad("valid", val, (val < 0) | (val > t), f"[0, T={t}]")
    if pos is not None:
        _check_position_span(pos, t)
    return rows, positions, valid


def check_cyclic_attention(q, view, rows, positions, kv_lens, sm_scale=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checks a cyclic attention call's inputs; returns ``(rows, positions, kv_lens)`` as int32 arrays."""
    check_cyclic_view(view)
    lay = view.layout
    b, t = _check_q(q, lay.num_kv_heads, lay.head_dim)
    max_t = lay.slots - lay.window + 1
    if t > max_t:
        raise ValueError(
            f"q has T={t} queries per row; a ring of slots={lay.slots} with window={lay.window} holds the keys of "
            f"at most T = slots - window + 1 = {max_t} queries (allocate slots >= window + T - 1)"
        )
    rows, positions, kv_lens = (
        check_int_vector(name, x, b) for name, x in (("rows", rows), ("positions", positions), ("kv_lens", kv_lens))
    )
    check_sm_scale(sm_scale)
    _check_cyclic_rows(rows, lay.rows)
    pos, lens = host_values(positions), host_values(kv_lens)
    if pos is not None:
        _first_bad("positions", pos, pos < 0, ">= 0")
        _check_position_span(pos, t)
    if lens is not None:
        _first_bad("kv_lens", lens, lens < 0, ">= 0")
    return rows, positions, kv_lens
