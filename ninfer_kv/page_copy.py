"""On-device copy of token columns between physical pages of one pool (partial-tail COW).

``copy_page_columns`` copies, for every entry ``i`` with ``columns[i] > 0``, token columns
``[0, columns[i])`` of physical page ``src[i]`` onto page ``dst[i]`` in **every** plane and layer of
the pool.  Columns ``>= columns[i]`` of the destination are left as they were, and so is every other
page.  ``src``, ``dst`` and ``columns`` are int32 arrays of one fixed padded length; entries with
``columns[i] == 0`` are no-ops, so callers pad with zeros.

On GPU (and for integer planes) the work is one jitted function with the planes donated: it gathers
the ``U`` source and destination pages, blends them by column and scatters the destinations back in
place.  On the CPU backend, which has no native bf16/fp8 update ops, float planes take a per-entry
raw-bits path (a small read-and-blend program, then an in-place update-slice of the bit-cast plane).
Either way every byte is copied exactly (NaN payloads included), each program compiles once per
(plane shapes, page axis, padded length), and only ``O(U)`` pages are touched, never whole planes.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .layout import PagedKVStorageLayout
from .ops.indices import int32_host_vector

__all__ = ["copy_page_columns", "page_axis_of", "compiled_variants"]


def page_axis_of(layout: PagedKVStorageLayout) -> int:
    """Axis of the physical page ID in the pool's stacked planes (1 page-major, 2 head-major)."""
    return layout.order.page_axis


_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _mask(columns, page_size: int, ndim: int, page_axis: int, u: int):
    """(U, P) column mask reshaped to broadcast against pages gathered along ``page_axis``."""
    mask = jnp.arange(page_size, dtype=jnp.int32)[None, :] < columns[:, None]
    shape = [1] * ndim
    shape[page_axis] = u
    shape[ndim - 2] = page_size
    return mask.reshape(shape)


@functools.partial(jax.jit, static_argnames=("page_axis",), donate_argnums=(0,))
def _copy_columns(planes, src, dst, columns, *, page_axis: int):
    """Batched: gather U source/destination pages, blend, scatter in place (native dtypes)."""
    out = {}
    u = src.shape[0]
    active = columns > 0
    for name, x in planes.items():
        n_pages = x.shape[page_axis]
        s = jnp.take(x, jnp.where(active, src, 0), axis=page_axis)
        d = jnp.take(x, jnp.where(active, dst, 0), axis=page_axis)
        blended = jnp.where(_mask(columns, x.shape[-2], x.ndim, page_axis, u), s, d)
        target = jnp.where(active, dst, n_pages)  # inactive entries scatter out of range: dropped
        out[name] = x.at[(slice(None),) * page_axis + (target,)].set(blended, mode="drop")
    return out


def _bits(x):
    bits = _UINT_OF_SIZE[jnp.dtype(x.dtype).itemsize]
    return x if x.dtype == bits else jax.lax.bitcast_convert_type(x, bits)


@functools.partial(jax.jit, static_argnames=("page_axis",))
def _blend_page(planes, entry, *, page_axis: int):
    """One entry ``(src, dst, columns)``: the destination page with columns ``[0, columns)`` taken
    from ``src``, as raw bits."""
    src, dst, columns = entry[0], entry[1], entry[2]
    out = {}
    for name, x in planes.items():
        s = _bits(jax.lax.dynamic_slice_in_dim(x, src, 1, axis=page_axis))
        d = _bits(jax.lax.dynamic_slice_in_dim(x, dst, 1, axis=page_axis))
        out[name] = jnp.where(_mask(columns[None], x.shape[-2], x.ndim, page_axis, 1), s, d)
    return out


@functools.partial(jax.jit, static_argnames=("page_axis",), donate_argnums=(0,))
def _write_page(planes, pages, entry, *, page_axis: int):
    """One entry: write a page of raw bits at ``entry[1]`` into the donated planes (in place)."""
    dst = entry[1]
    out = {}
    for name, plane in planes.items():
        x = jax.lax.dynamic_update_slice_in_dim(_bits(plane), pages[name], dst, axis=page_axis)
        out[name] = x if x.dtype == plane.dtype else jax.lax.bitcast_convert_type(x, plane.dtype)
    return out


def _cpu_float(planes) -> bool:
    """Whether the planes need the per-entry raw-bits path.

    XLA's CPU backend has no native bf16 / fp8 scatter or update-slice: it widens the whole plane to
    f32 and back (a pass over the plane that also rewrites NaN payloads).  There each entry is read
    and blended as raw bits by one small program and written by an in-place update-slice of the
    bit-cast plane.  GPU backends update these dtypes natively, in place, in one batched program.
    """
    for x in planes.values():
        if not jnp.issubdtype(x.dtype, jnp.integer) and "cpu" in {d.platform for d in x.devices()}:
            return True
    return False


def compiled_variants() -> int:
    """Compiled programs behind :func:`copy_page_columns` so far (for compile-count tests)."""
    return _copy_columns._cache_size() + _blend_page._cache_size() + _write_page._cache_size()


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
    planes = dict(planes)
    if _cpu_float(planes):
        for i in np.flatnonzero(active).tolist():
            entry = np.array([src[i], dst[i], columns[i]], np.int32)  # fresh: never mutated after use
            pages = _blend_page(planes, entry, page_axis=axis)
            planes = _write_page(planes, pages, entry, page_axis=axis)
        return planes
    return _copy_columns(planes, src, dst, columns, page_axis=axis)
