"""On-device copy of token columns between physical pages of one pool (partial-tail COW).

``copy_page_columns`` copies, for every entry ``i`` with ``columns[i] > 0``, token columns
``[0, columns[i])`` of physical page ``src[i]`` onto page ``dst[i]`` in **every** plane and layer of
the pool.  Columns ``>= columns[i]`` of the destination are left as they were, and so is every other
page.  ``src``, ``dst`` and ``columns`` are int32 arrays of one fixed padded length; entries with
``columns[i] == 0`` are no-ops, so callers pad with zeros.

The page writes here are also those of the KV store's round work (:func:`write_pages`, pure, for
use inside a caller's jitted step; :func:`write_pages_donated`, dispatched): COW copies from device
pages and Host restores from a payload, every source read before any destination is written.

On GPU (and for integer planes) the work is one jitted function with the planes donated: it gathers
the ``U`` source and destination pages, blends them by column and scatters the destinations back in
place.  On the CPU backend, which has no native bf16/fp8 update ops and copies a bit-cast plane
that a scatter writes, float planes take a per-page raw-bits path (one read-and-blend program for
every entry, then an in-place update-slice of the bit-cast plane per entry).  Either way every byte
is copied exactly (NaN payloads included), each program compiles once per (plane shapes, page axis,
padded length), and only ``O(U)`` pages are touched, never whole planes.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .int_arrays import int32_host_vector
from ..schema.layout import PagedKVStorageLayout, word_dtype

__all__ = [
    "copy_page_columns",
    "page_axis_of",
    "compiled_variants",
    "blended_pages",
    "write_pages",
    "write_pages_donated",
]


def page_axis_of(layout: PagedKVStorageLayout) -> int:
    """Axis of the physical page ID in the pool's stacked planes (1 page-major, 2 head-major)."""
    return layout.order.page_axis


def _words(x: jax.Array) -> jax.Array:
    w = jnp.dtype(word_dtype(x.dtype))
    return x if x.dtype == w else jax.lax.bitcast_convert_type(x, w)


def _from_words(words: jax.Array, dtype) -> jax.Array:
    return words if words.dtype == dtype else jax.lax.bitcast_convert_type(words, dtype)


def _column_mask(columns: jax.Array, ndim: int, axis: int, page_size: int) -> jax.Array:
    mask = jnp.arange(page_size, dtype=jnp.int32)[None, :] < columns[:, None]  # (U, P)
    shape = [1] * ndim
    shape[axis] = columns.shape[0]
    shape[ndim - 2] = page_size
    return mask.reshape(shape)


def blended_pages(planes: dict, copies: jax.Array, restores: jax.Array, payload: dict, axis: int, enabled=None):
    """Every page write's final destination page, read before any write lands (pure).

    ``copies``: int32 ``(3, K)`` ``(src, dst, columns)``; ``restores``: int32 ``(2, R)``
    ``(dst, columns)`` with ``payload[plane]`` words ``(R, layers, H, P, X)``.  Returns per plane the
    ``K + R`` blended pages (words, along ``axis``: columns ``< columns`` from the source, the rest
    from the destination) and the destinations (``-1`` for padding entries, ``columns == 0``).
    ``enabled`` (a bool scalar, default true): when false every entry is padding (nothing changes).
    """
    k, r = copies.shape[1], restores.shape[1]
    dst = jnp.concatenate([copies[1], restores[0]])
    cols = jnp.concatenate([copies[2], restores[1]])
    if enabled is not None:
        cols = jnp.where(enabled, cols, 0)
    out = {}
    for name, plane in planes.items():
        words = _words(plane)
        n = words.shape[axis]
        parts = []
        if k:
            parts.append(jnp.take(words, jnp.clip(copies[0], 0, n - 1), axis=axis))
        if r:
            parts.append(jnp.moveaxis(jnp.asarray(payload[name]).astype(words.dtype), 0, axis))
        src = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)
        old = jnp.take(words, jnp.clip(dst, 0, n - 1), axis=axis)
        out[name] = jnp.where(_column_mask(cols, words.ndim, axis, words.shape[-2]), src, old)
    return out, jnp.where(cols > 0, dst, -1)


def write_pages(planes: dict, copies: jax.Array, restores: jax.Array, payload: dict, axis: int, enabled=None) -> dict:
    """Pure: apply the page writes (see :func:`blended_pages`) with one batched scatter per plane.

    On accelerators the scatter updates donated planes in place; on XLA's CPU backend a scatter into
    a float plane is not kept in place (the plane is copied), which :func:`write_pages_donated`
    avoids.  ``enabled``: as :func:`blended_pages`.
    """
    if copies.shape[1] == 0 and restores.shape[1] == 0:
        return planes
    blended, dst = blended_pages(planes, copies, restores, payload, axis, enabled)
    out = {}
    for name, plane in planes.items():
        words = _words(plane)
        target = jnp.where(dst >= 0, dst, words.shape[axis])  # padding: out of range, dropped
        words = words.at[(slice(None),) * axis + (target,)].set(blended[name], mode="drop")
        out[name] = _from_words(words, plane.dtype)
    return out


_write_pages_jit = jax.jit(write_pages, static_argnames=("axis",), donate_argnums=(0,))
_blended_jit = jax.jit(blended_pages, static_argnames=("axis",))


@functools.partial(jax.jit, static_argnames=("axis",), donate_argnums=(0,))
def _write_entry(planes, blended, entry, *, axis):
    """Write page ``entry[0]`` of ``blended`` at page ``entry[1]`` of the donated planes: one
    update-slice per program, which XLA's CPU backend keeps in place."""
    out = {}
    for name, plane in planes.items():
        page = jax.lax.dynamic_slice_in_dim(blended[name], entry[0], 1, axis=axis)
        words = jax.lax.dynamic_update_slice_in_dim(_words(plane), page, entry[1], axis=axis)
        out[name] = _from_words(words, plane.dtype)
    return out


def cpu_float(planes) -> bool:
    """Whether the planes need the per-page path of :func:`write_pages_donated`.

    XLA's CPU backend has no native bf16 / fp8 scatter, and it copies a bit-cast plane that a
    scatter or a chain of updates writes; one update-slice of a bit-cast plane per program stays in
    place.  GPU backends update every dtype natively, in place, in one batched program.
    """
    for x in planes.values():
        if not jnp.issubdtype(x.dtype, jnp.integer) and "cpu" in {d.platform for d in x.devices()}:
            return True
    return False


def write_pages_donated(planes: dict, copies, restores, payload, axis: int, enabled=None) -> dict:
    """:func:`write_pages` as dispatched programs with the planes donated, in place on every backend:
    one batched program, or on CPU float planes one read-only program forming every destination
    page and one update-slice program per written page (which rewrites the page unchanged when
    ``enabled``, a device bool scalar, is false)."""
    if not cpu_float(planes):
        return _write_pages_jit(planes, copies, restores, payload, axis=axis, enabled=enabled)
    cols = np.concatenate([np.asarray(copies)[2], np.asarray(restores)[1]])
    active = np.flatnonzero(cols > 0)
    if not active.size:
        return dict(planes)
    targets = np.concatenate([np.asarray(copies)[1], np.asarray(restores)[0]])
    blended, _ = _blended_jit(planes, copies, restores, payload, axis=axis, enabled=enabled)
    planes = dict(planes)
    for i in active.tolist():
        entry = np.array([i, targets[i]], np.int32)  # fresh: never mutated after the dispatch
        planes = _write_entry(planes, blended, entry, axis=axis)
    return planes


def compiled_variants() -> int:
    """Compiled programs behind :func:`copy_page_columns` so far (for compile-count tests)."""
    return _write_pages_jit._cache_size() + _blended_jit._cache_size() + _write_entry._cache_size()


def _host_int32(name: str, values) -> np.ndarray:
    """Any 1-D integer array-like as int32 (TypeError for other dtypes, ValueError on overflow)."""
    return int32_host_vector(name, values)


def copy_page_columns(
    planes: Mapping[str, jax.Array], src: ArrayLike, dst: ArrayLike, columns: ArrayLike, *, layout: PagedKVStorageLayout
) -> dict[str, jax.Array]:
    """Copy token columns ``[0, columns[i])`` of page ``src[i]`` to page ``dst[i]`` in every plane.

    Args:
      planes: the pool's stacked planes keyed by plane name (as ``layout.allocate`` returns them).
        They are **donated**: use only the returned dict afterwards.
      src, dst, columns: integer arrays (any integer dtype, lists) of one padded length ``U``;
        ``0 <= columns[i] <= P``; entries
        with ``columns[i] == 0`` do nothing.  Active destinations must be distinct and must not be
        active sources.
      layout: the pool's :class:`PagedKVStorageLayout` (plane names, shapes, page axis).

    Returns:
      The new planes dict (same keys, shapes and dtypes).
    """
    if not isinstance(layout, PagedKVStorageLayout):
        raise TypeError(f"layout must be a PagedKVStorageLayout, got {type(layout).__name__}")
    src = _host_int32("src", src)
    dst = _host_int32("dst", dst)
    columns = _host_int32("columns", columns)
    if not src.shape == dst.shape == columns.shape:
        raise ValueError(f"src, dst and columns must have one length; got {src.shape}, {dst.shape}, {columns.shape}")
    if set(planes) != set(layout.plane_names):
        raise ValueError(f"planes have keys {sorted(planes)}; the layout needs {sorted(layout.plane_names)}")
    axis = page_axis_of(layout)
    first = planes[layout.plane_names[0]]
    n_pages = int(first.shape[axis])
    expected = layout.plane_shapes(n_pages)
    for name, x in planes.items():
        if tuple(x.shape) != expected[name] or np.dtype(x.dtype) != layout.plane(name).dtype:
            raise ValueError(
                f"plane {name!r} has shape {tuple(x.shape)} dtype {x.dtype}; the layout needs "
                f"{expected[name]} {layout.plane(name).dtype}"
            )
    P = layout.page_size
    if columns.size and (columns.min() < 0 or columns.max() > P):
        raise ValueError(f"columns must lie in [0, {P}], got {columns.tolist()}")
    active = columns > 0
    for name, ids in (("src", src), ("dst", dst)):
        a = ids[active]
        if a.size and (a.min() < 0 or a.max() >= n_pages):
            raise ValueError(f"{name} page IDs must lie in [0, {n_pages}), got {a.tolist()}")
    d = dst[active].tolist()
    if len(set(d)) != len(d):
        raise ValueError(f"active destination pages must be distinct, got {d}")
    if set(d) & set(src[active].tolist()):
        raise ValueError("an active destination page is also an active source page")
    copies = np.stack([src, dst, columns])
    restores = np.zeros((2, 0), np.int32)
    return write_pages_donated(dict(planes), copies, restores, {}, axis)
