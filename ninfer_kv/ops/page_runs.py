"""Gather and scatter whole pages of a pool by runs of physical page IDs (Host transfers).

A *run* ``r`` is the physical page IDs ``run_starts[r] .. run_starts[r] + run_lengths[r] - 1`` of a
pool; runs come from coalescing adjacent IDs of a checkpoint's pages in logical order.  A
*payload* holds the pages of all runs concatenated in run order along the page axis, for every
plane and layer:

* page-major pool ``(num_layers, N, H, P, X)`` -> payload ``(num_layers, n, H, P, X)``;
* head-major pool ``(num_layers, H, N, P, X)`` -> payload ``(num_layers, H, n, P, X)``.

Shapes are fixed and padded; the run structure is data.  ``run_starts`` and ``run_lengths`` are int32
vectors of one length ``R`` (pad with zero-length runs) and the payload holds ``n >= sum(lengths)``
pages (pages past the total are zeros on gather and ignored on scatter).  The jit cache key is
therefore ``(plane shapes and dtypes, R, n)``: page IDs and run lengths never cause a
recompilation, and a caller that buckets ``R`` and ``n`` (e.g. to powers of two) compiles a handful
of programs for its whole lifetime.

Each call is one jitted program: gather is an XLA gather of ``n`` pages per plane (the payload is
the only output; nothing proportional to the pool is materialized); scatter writes ``n`` pages into
the **donated** planes.  Both move raw bits (float planes are bitcast to unsigned integers of the
same width), so every byte, NaN payloads included, is copied exactly.  Integer planes (int8 codes,
NVFP4 bytes and scales) are updated in place; XLA's CPU backend has no in-place scatter for 16/8-bit
float element types and copies each bf16/e4m3 plane once around the update.  Run arrays must be host values of any integer dtype (numpy arrays,
Python lists, concrete ``jax`` arrays): they are validated before the program runs.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ..schema.layout import PagedKVStorageLayout
from .int_arrays import host_int_array

__all__ = ["gather_page_runs", "scatter_page_runs", "run_page_ids"]


def run_page_ids(run_starts: jax.Array, run_lengths: jax.Array, num_out: int, num_pages: int) -> jax.Array:
    """Physical page ID of every payload page ``(num_out,)``; padding pages get ``num_pages``.

    Works on traced int32 vectors of length ``R >= 1``; ``num_out`` and ``num_pages`` are static.
    """
    ends = jnp.cumsum(run_lengths)  # (R,) inclusive prefix sums
    i = jnp.arange(num_out, dtype=jnp.int32)
    r = jnp.minimum(jnp.searchsorted(ends, i, side="right"), run_lengths.shape[0] - 1).astype(jnp.int32)
    ids = run_starts[r] + (i - (ends[r] - run_lengths[r]))
    return jnp.where(i < ends[-1], ids, num_pages).astype(jnp.int32)


def _page_index(axis: int, ids: jax.Array) -> tuple:
    return (slice(None),) * axis + (ids,)


def _raw(x: jax.Array) -> jax.Array:
    """Float planes as unsigned integers of the same width: copies then move bits, never values
    (XLA's CPU gather/scatter canonicalizes NaN payloads of bf16/fp8 elements)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return x


def _cooked(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


@functools.partial(jax.jit, static_argnames=("page_axis", "num_out"))
def _gather(planes, run_starts, run_lengths, *, page_axis: int, num_out: int):
    num_pages = next(iter(planes.values())).shape[page_axis]
    ids = run_page_ids(run_starts, run_lengths, num_out, num_pages)
    return {
        name: _cooked(jnp.take(_raw(x), ids, axis=page_axis, mode="fill", fill_value=0), x.dtype)
        for name, x in planes.items()
    }


@functools.partial(jax.jit, static_argnames=("page_axis",), donate_argnums=(0,))
def _scatter(planes, run_starts, run_lengths, payload, *, page_axis: int):
    num_pages = next(iter(planes.values())).shape[page_axis]
    num_out = next(iter(payload.values())).shape[page_axis]
    ids = run_page_ids(run_starts, run_lengths, num_out, num_pages)
    index = _page_index(page_axis, ids)
    return {
        name: _cooked(_raw(x).at[index].set(_raw(payload[name]), mode="drop"), x.dtype)
        for name, x in planes.items()
    }


# -- host-side checks ----------------------------------------------------------------------------


def _check_planes(planes: Mapping, layout: PagedKVStorageLayout, what: str, num_pages: int | None = None) -> int:
    """Keys, shapes and dtypes of stacked planes against ``layout``; returns their page count."""
    if not isinstance(layout, PagedKVStorageLayout):
        raise TypeError(f"layout must be a PagedKVStorageLayout, got {type(layout).__name__}")
    if not isinstance(planes, Mapping) or set(planes) != set(layout.plane_names):
        keys = sorted(planes) if isinstance(planes, Mapping) else type(planes).__name__
        raise ValueError(f"{what} keyed {keys}; the layout needs exactly {sorted(layout.plane_names)}")
    axis = layout.order.page_axis
    first = planes[layout.plane_names[0]]
    if not hasattr(first, "shape") or len(first.shape) != 5:
        raise ValueError(f"{what} plane {layout.plane_names[0]!r} must be 5-D (layer axis first), got {getattr(first, 'shape', None)}")
    n = int(first.shape[axis]) if num_pages is None else num_pages
    for name, want in layout.plane_shapes(max(n, 1)).items():
        want = list(want)
        want[axis] = n
        x = planes[name]
        if tuple(x.shape) != tuple(want) or np.dtype(x.dtype) != layout.plane(name).dtype:
            raise ValueError(
                f"{what} plane {name!r} has shape {tuple(x.shape)} dtype {np.dtype(x.dtype).name}; "
                f"expected {tuple(want)} {layout.plane(name).dtype.name}"
            )
    return n


def _host_runs(run_starts, run_lengths, num_pages: int, *, disjoint: bool) -> tuple[np.ndarray, np.ndarray]:
    starts, lengths = (host_int_array(name, x) for name, x in (("run_starts", run_starts), ("run_lengths", run_lengths)))
    if starts.shape != lengths.shape:
        raise ValueError(f"run_starts and run_lengths must have one length, got {starts.shape[0]} and {lengths.shape[0]}")
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"run_lengths[{i}]={int(lengths[i])} is negative; allowed: >= 0")
    live = lengths > 0
    bad = live & ((starts < 0) | (starts + lengths > num_pages))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"run {i} = pages [{int(starts[i])}, {int(starts[i] + lengths[i])}) is out of range; "
            f"runs must lie in [0, N={num_pages})"
        )
    if disjoint and live.sum() > 1:
        s, e = starts[live], starts[live] + lengths[live]
        order = np.argsort(s, kind="stable")
        overlap = s[order][1:] < e[order][:-1]
        if overlap.any():
            j = int(np.argmax(overlap))
            raise ValueError(
                f"runs [{int(s[order][j])}, {int(e[order][j])}) and [{int(s[order][j + 1])}, {int(e[order][j + 1])}) "
                f"overlap; a scatter writes each destination page once"
            )
    if starts.size == 0:  # one zero-length padding run keeps the program shape-valid
        starts, lengths = np.zeros(1, np.int64), np.zeros(1, np.int64)
    return np.where(live, starts, 0).astype(np.int32), lengths.astype(np.int32)


# -- public --------------------------------------------------------------------------------------


def gather_page_runs(
    planes: Mapping[str, jax.Array],
    run_starts: ArrayLike,
    run_lengths: ArrayLike,
    *,
    layout: PagedKVStorageLayout,
    num_pages: int | None = None,
) -> dict[str, jax.Array]:
    """Pages of the runs, concatenated in run order, for every plane and layer.

    Args:
      planes: the pool's stacked planes (``layout.allocate`` keys and shapes); not modified.
      run_starts, run_lengths: host integer vectors (any integer dtype, lists) of one length ``R``; run ``r`` covers physical pages
        ``[run_starts[r], run_starts[r] + run_lengths[r])`` (within ``[0, N)``; zero-length runs
        are padding and may start anywhere).
      layout: the pool's :class:`PagedKVStorageLayout`.
      num_pages: payload page count ``n`` (default ``sum(run_lengths)``); must be
        ``>= sum(run_lengths)``; pages past the total are zeros.  Pad it to bound compilations.

    Returns:
      ``{plane: payload}`` with ``(num_layers, n, H, P, X)`` (page-major) or
      ``(num_layers, H, n, P, X)`` (head-major) arrays.
    """
    n_phys = _check_planes(planes, layout, "planes")
    starts, lengths = _host_runs(run_starts, run_lengths, n_phys, disjoint=False)
    total = int(lengths.sum())
    n_out = total if num_pages is None else num_pages
    if not isinstance(n_out, (int, np.integer)) or isinstance(n_out, bool) or n_out < total:
        raise ValueError(f"num_pages={num_pages!r} is invalid; it must be an integer >= sum(run_lengths) = {total}")
    return _gather(dict(planes), starts, lengths, page_axis=layout.order.page_axis, num_out=int(n_out))


def scatter_page_runs(
    planes: Mapping[str, jax.Array],
    run_starts: ArrayLike,
    run_lengths: ArrayLike,
    payload: Mapping[str, jax.Array],
    *,
    layout: PagedKVStorageLayout,
) -> dict[str, jax.Array]:
    """Write payload pages back onto the runs' physical pages, in place (inverse of the gather).

    Args:
      planes: the pool's stacked planes; **donated**: use only the returned dict afterwards.
      run_starts, run_lengths: as for :func:`gather_page_runs`; live runs must not overlap.
      payload: ``{plane: array}`` shaped like :func:`gather_page_runs` output with ``n`` pages,
        ``n >= sum(run_lengths)``; pages past the total are ignored.
      layout: the pool's :class:`PagedKVStorageLayout`.

    Returns:
      The updated planes; every page outside the runs is unchanged.
    """
    n_phys = _check_planes(planes, layout, "planes")
    if not isinstance(payload, Mapping) or not payload:
        raise ValueError(f"payload must be a dict of plane arrays keyed {sorted(layout.plane_names)}")
    first = payload.get(layout.plane_names[0])
    n_out = int(first.shape[layout.order.page_axis]) if hasattr(first, "shape") and len(first.shape) == 5 else -1
    _check_planes(payload, layout, "payload", num_pages=max(n_out, 0))
    starts, lengths = _host_runs(run_starts, run_lengths, n_phys, disjoint=True)
    total = int(lengths.sum())
    if n_out < total:
        raise ValueError(f"payload holds {n_out} pages, fewer than sum(run_lengths) = {total}")
    return _scatter(dict(planes), starts, lengths, dict(payload), page_axis=layout.order.page_axis)
