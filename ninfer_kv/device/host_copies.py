"""Device <-> Host page copies: between a pool's planes (device arrays) and a packed Host extent.

* :func:`offload_pages` copies physical pages (given in logical order) into an extent.
* :func:`restore_pages` writes an extent's pages back into (possibly different, scattered)
  physical pages and returns the new planes.

Both walk the page IDs as runs of adjacent physical IDs (:func:`~ninfer_kv.host.page_id_runs.coalesce_runs`);
each run is one contiguous slice of the planes.  Two paths implement the same byte contract:

``"packed"`` (default on accelerators)
  * offload: a jitted gather slices a chunk's runs out of every plane along the page axis and packs
    them, on the device, into the Host byte layout, producing one ``uint8 (pages, stride)`` array;
    that array is fetched (one Device -> Host copy per chunk) and copied into the extent with one
    ``memcpy``.
    Gathers are dispatched ahead of the fetches, up to ``max_inflight_bytes`` of packed data, so
    device work and copies overlap.
  * restore: the extent's rows of a chunk go to the device in one Host -> Device copy and a jitted
    scatter, with the planes **donated**, unpacks them and writes each run in place with
    ``dynamic_update_slice`` along the page axis.

``"host"`` (default when the planes live on the CPU, where device memory is host memory)
  * offload: the planes are read in place (``np.asarray`` of a CPU array is a zero-copy, read-only
    view; no reference outlives the call, so later donations still update in place) and each run
    is copied straight into the extent's per-plane views: one pass over the bytes.
  * restore: each chunk's per-plane blocks are copied out of the extent into private staging
    buffers in the device plane order and a jitted, donated ``dynamic_update_slice`` per run writes
    them.
  XLA's CPU code for byte-level bit-casts and concatenation is far slower than ``memcpy``, which is
  why the packing moves to numpy there.

Every device-side copy works on unsigned integer words of the element width (``uint8`` /
``uint16``): a float path may quiet signalling-NaN bit patterns (XLA CPU does so for bf16 inside
fused updates), and the payload must round-trip byte-exactly whatever it holds.

Compilation.  Page IDs are data (traced int32 run starts), never shapes.  The static quantities are
the shape of a chunk (:func:`~ninfer_kv.host.page_id_runs.split_runs`): runs are cut into power-of-two
pieces of at most ``bucket_cap`` pages (the largest power of two whose payload fits
``max_chunk_bytes``, at least 1 and at most 1024 pages; ``max_chunk_bytes`` defaults to 64 MiB on
the packed path and 4 MiB on the host path).  Offload batches consecutive single-page pieces in
power-of-two counts, so one gather and one Device -> Host copy move many scattered pages: at most
``2 * log2(bucket_cap) + 1`` variants.  Restore writes one run per call (a chain of in-place
updates in one computation is not reliably kept in place by XLA: on CPU a float8 plane is then
copied whole), so at most ``log2(bucket_cap) + 1`` variants.  The host-path offload runs no jitted
code, so its chunks are its runs.

The copy is always of whole pages: columns beyond a partial tail's committed frontier are copied
too (a page's payload is the whole page).  Offload is synchronous: when it returns, every byte is in
the extent, so the caller can verify epoch and coverage and publish the replica.  Restore returns
once the extent's bytes are no longer needed (Host -> Device copies awaited or taken from private
copies), so the extent may be released right after; the scatters into the planes stay
asynchronous and the returned planes are ordinary arrays ordered by data dependency.

The gather/scatter helpers are local to this module: they pack to the Host byte layout, which a
generic page gather would not do.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..host.arena import HostKVArena
from ..host.block_copy import copy_blocks
from ..host.extent_allocator import HostExtent
from ..host.host_layout import HostKVPageLayout, TransferReport, host_layout_of
from ..host.page_id_runs import check_page_ids, coalesce_runs, max_bucket_pages, split_runs
from ..schema.layout import PagedKVStorageLayout
from .host_staging import start_to_host, to_device

__all__ = ["offload_pages", "restore_pages", "TRANSFER_PATHS"]

DEFAULT_MAX_CHUNK_BYTES = {"packed": 64 << 20, "host": 4 << 20}
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
TRANSFER_PATHS = ("auto", "packed", "host")
"""The transfer paths :func:`offload_pages` / :func:`restore_pages` accept."""


_UINT_OF_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def _word_dtype(dtype) -> np.dtype:
    return _UINT_OF_SIZE[np.dtype(dtype).itemsize]


def _as_words(x: jax.Array) -> jax.Array:
    """Same-width bit-cast to unsigned integer words (a free bitcast in XLA)."""
    return jax.lax.bitcast_convert_type(x, _word_dtype(x.dtype))


def _to_bytes(x: jax.Array) -> jax.Array:
    """Bit-cast words ``(n, ...)`` to ``uint8 (n, bytes)``, bytes in memory (little-endian) order."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)  # itemsize > 1 adds a trailing byte axis
    return b.reshape(x.shape[0], -1)


def _from_bytes(b: jax.Array, word_dtype, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`_to_bytes`: ``uint8`` rows -> words of ``shape``."""
    itemsize = np.dtype(word_dtype).itemsize
    if itemsize == 1:
        return b.reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(shape + (itemsize,)), word_dtype)


# -- jitted copies ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("host_layout", "n"))
def _gather_packed(planes, starts, *, host_layout: HostKVPageLayout, n: int):
    """Runs ``[starts[j], starts[j] + n)`` of every plane, packed into ``uint8 (G * n, stride)``."""
    lay = host_layout.layout
    axis = lay.order.page_axis
    parts = []
    for name in lay.plane_names:
        # slice first, then bit-cast the slice: a bit-cast of a whole float8 plane is not free on CPU
        runs = [
            _as_words(jax.lax.dynamic_slice_in_dim(planes[name], starts[j], n, axis=axis))
            for j in range(starts.shape[0])
        ]
        x = runs[0] if len(runs) == 1 else jnp.concatenate(runs, axis=axis)
        parts.append(_to_bytes(jnp.moveaxis(x, axis, 0)))  # (G * n, L, H, P, X) -> bytes
    return jnp.concatenate(parts, axis=1)


def _update_runs(words: jax.Array, x: jax.Array, starts, n: int, axis: int) -> jax.Array:
    """Write ``x`` (``G * n`` pages along ``axis``) as runs of ``n`` pages at ``starts``."""
    for j in range(starts.shape[0]):
        run = jax.lax.slice_in_dim(x, j * n, (j + 1) * n, axis=axis)
        words = jax.lax.dynamic_update_slice_in_dim(words, run, starts[j], axis)
    return words


@functools.partial(jax.jit, static_argnames=("host_layout", "n"), donate_argnums=(0,))
def _scatter_packed(planes, starts, block, *, host_layout: HostKVPageLayout, n: int):
    """Write packed ``uint8 (G * n, stride)`` pages as runs of ``n`` pages at ``starts``."""
    lay = host_layout.layout
    axis = lay.order.page_axis
    pages = block.shape[0]
    out = {}
    for spec in lay.planes:
        off = host_layout.plane_offset(spec.name)
        seg = block[:, off : off + host_layout.plane_block_bytes(spec.name)]
        words = _as_words(planes[spec.name])
        x = _from_bytes(seg, words.dtype, (pages, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent))
        words = _update_runs(words, jnp.moveaxis(x, 0, axis), starts, n, axis)
        out[spec.name] = jax.lax.bitcast_convert_type(words, spec.dtype)
    return out


@functools.partial(jax.jit, static_argnames=("axis", "n"), donate_argnums=(0,))
def _scatter_words(planes, starts, blocks, *, axis: int, n: int):
    """Write per-plane word blocks (device plane order, ``G * n`` pages) as runs at ``starts``.

    Also returns a token that is ready once the whole call has run, i.e. once the blocks are read.
    """
    out = {}
    for name, plane in planes.items():
        words = _update_runs(_as_words(plane), blocks[name], starts, n, axis)
        out[name] = jax.lax.bitcast_convert_type(words, plane.dtype)
    return out, starts[0]


# -- validation -------------------------------------------------------------------------------------


def _resolve_layout(layout) -> HostKVPageLayout:
    if isinstance(layout, HostKVPageLayout):
        return layout
    if isinstance(layout, PagedKVStorageLayout):
        return host_layout_of(layout)
    raise TypeError(f"layout must be a PagedKVStorageLayout or HostKVPageLayout, got {type(layout).__name__}")


def _check_planes(planes, layout: PagedKVStorageLayout) -> int:
    """Validate plane keys, shapes and dtypes against the layout; returns the pool's page count."""
    if not isinstance(planes, dict) or set(planes) != set(layout.plane_names):
        got = sorted(planes) if isinstance(planes, dict) else type(planes).__name__
        raise ValueError(f"planes must be a dict keyed exactly {list(layout.plane_names)}, got {got}")
    k = planes["k"]
    if not hasattr(k, "shape") or len(k.shape) != 5:
        raise ValueError(f"plane 'k' must be a stacked 5-D array, got shape {getattr(k, 'shape', None)}")
    n = int(k.shape[layout.order.page_axis])
    for name, shape in layout.plane_shapes(n).items():
        arr = planes[name]
        if tuple(arr.shape) != shape or np.dtype(arr.dtype) != layout.plane(name).dtype:
            raise ValueError(
                f"plane {name!r} has shape {tuple(arr.shape)} dtype {np.dtype(arr.dtype).name}; the layout "
                f"needs {shape} {layout.plane(name).dtype.name} for {n} pages (page count read from plane 'k')"
            )
    return n


def _platform(planes) -> str:
    k = planes["k"]
    if isinstance(k, jax.Array):
        return next(iter(k.devices())).platform
    return "cpu"  # numpy planes


def _select_path(path: str, planes) -> str:
    if path not in TRANSFER_PATHS:
        raise ValueError(f"path={path!r} is invalid; allowed: {', '.join(TRANSFER_PATHS)}")
    platform = _platform(planes)
    if path == "auto":
        return "host" if platform == "cpu" else "packed"
    if path == "host" and platform != "cpu":
        raise ValueError(f"path='host' reads the planes in place and needs CPU planes; these are on {platform}")
    return path


def _plan(planes, layout, page_ids, arena, extent, first_page, max_chunk_bytes, path, group_singles):
    host_layout = _resolve_layout(layout)
    if not isinstance(arena, HostKVArena):
        raise TypeError(f"arena must be a HostKVArena, got {type(arena).__name__}")
    arena.check(extent)
    num_pages = _check_planes(planes, host_layout.layout)
    path = _select_path(path, planes)
    ids = check_page_ids(page_ids, num_pages)
    extent_pages = host_layout.pages_in(extent.nbytes)
    if not isinstance(first_page, (int, np.integer)) or isinstance(first_page, bool):
        raise TypeError(f"first_page must be an int, got {type(first_page).__name__}")
    if first_page < 0 or first_page + ids.size > extent_pages:
        raise ValueError(
            f"pages [{first_page}, {first_page + ids.size}) do not fit the extent of {extent_pages} pages "
            f"(first_page must be in [0, {extent_pages - ids.size}])"
        )
    starts, lengths = coalesce_runs(ids)
    if max_chunk_bytes is None:
        max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES[path]
    cap = max_bucket_pages(host_layout.stride, max_chunk_bytes)
    chunks = split_runs(starts, lengths, cap, cap if group_singles else 1)
    return host_layout, path, starts, lengths, chunks, int(ids.size)


def _starts(chunk) -> np.ndarray:
    return np.asarray(chunk.physical_starts, dtype=np.int32)


def _report(host_layout, pages, runs, chunks, path) -> TransferReport:
    return TransferReport(pages=pages, runs=runs, chunks=chunks, bytes=pages * host_layout.stride, path=path)


def _word_views(host_layout: HostKVPageLayout, arena: HostKVArena, extent: HostExtent) -> dict[str, np.ndarray]:
    """Per-plane ``(pages, L, H, P, X)`` word views of an extent."""
    return {
        name: v.view(_word_dtype(v.dtype)) for name, v in host_layout.page_planes(arena.view(extent)).items()
    }


# -- public API -------------------------------------------------------------------------------------


def offload_pages(
    planes: dict,
    layout,
    page_ids,
    arena: HostKVArena,
    extent: HostExtent,
    *,
    first_page: int = 0,
    path: str = "auto",
    max_chunk_bytes: int | None = None,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
) -> TransferReport:
    """Device -> Host: copy physical pages ``page_ids`` (logical order) into an extent.

    Logical page ``i`` of the transfer (physical ``page_ids[i]``) lands in extent page
    ``first_page + i``.  ``planes`` are read, not donated.

    Args:
      planes: the pool's stacked planes (as ``layout.allocate`` returns them).
      layout: the pool's ``PagedKVStorageLayout`` (or its ``HostKVPageLayout``).
      page_ids: distinct physical page IDs in ``[0, N)``, in logical order.
      arena, extent: a live extent of ``arena`` sized for this layout (a multiple of the stride).
      first_page: extent page receiving the first transferred page.
      path: ``"auto"``, ``"packed"`` or ``"host"`` (see the module docstring).
      max_chunk_bytes: cap on one jitted copy (sets the power-of-two bucket cap); default 64 MiB on
        the packed path, 4 MiB on the host path (cache-sized blocks copy fastest there).
      max_inflight_bytes: packed bytes gathered on the device ahead of the fetches.

    Returns:
      :class:`TransferReport`.  Returns after the last byte landed in the extent.
    """
    host_layout, path, starts, lengths, chunks, pages = _plan(
        planes, layout, page_ids, arena, extent, first_page, max_chunk_bytes, path, group_singles=True
    )
    if pages == 0:
        return _report(host_layout, 0, 0, 0, path)
    if path == "host":
        _offload_host(planes, host_layout, starts, lengths, _word_views(host_layout, arena, extent), first_page)
        return _report(host_layout, pages, starts.size, starts.size, path)
    rows = arena.view(extent).reshape(-1, host_layout.stride)
    stride = host_layout.stride
    pending: collections.deque = collections.deque()
    inflight = 0

    def land_oldest() -> int:
        chunk, fetched = pending.popleft()
        lo = first_page + chunk.logical_start
        rows[lo : lo + chunk.pages] = np.asarray(fetched)
        return chunk.pages * stride

    for chunk in chunks:
        packed = _gather_packed(planes, _starts(chunk), host_layout=host_layout, n=chunk.length)
        pending.append((chunk, start_to_host(arena, packed)))
        inflight += chunk.pages * stride
        while inflight > max_inflight_bytes and len(pending) > 1:
            inflight -= land_oldest()
    while pending:
        land_oldest()
    return _report(host_layout, pages, starts.size, len(chunks), path)


def _offload_host(planes, host_layout, starts, lengths, views, first_page) -> None:
    """CPU planes: copy each run straight from the (zero-copy) plane buffers into the extent views."""
    axis = host_layout.layout.order.page_axis
    sources = {name: np.asarray(planes[name]) for name in views}  # blocks until the planes are ready
    sources = {name: src.view(_word_dtype(src.dtype)) for name, src in sources.items()}
    logical = first_page
    for start, length in zip(starts.tolist(), lengths.tolist()):
        for name, view in views.items():
            run = sources[name][(slice(None),) * axis + (slice(start, start + length),)]
            copy_blocks(view[logical : logical + length], np.moveaxis(run, axis, 0))
        logical += length


def restore_pages(
    planes: dict,
    layout,
    page_ids,
    arena: HostKVArena,
    extent: HostExtent,
    *,
    first_page: int = 0,
    path: str = "auto",
    max_chunk_bytes: int | None = None,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
) -> tuple[dict, TransferReport]:
    """Host -> Device: write extent pages into physical pages ``page_ids`` and return the planes.

    Extent page ``first_page + i`` is written to physical page ``page_ids[i]`` (any permutation
    of any free IDs; they need not be the IDs the pages were offloaded from).  Every other page is
    unchanged.

    ``planes`` are **donated** to the jitted scatter: use only the returned dict afterwards.
    Returns once the extent's bytes are no longer needed (the runtime may read a host buffer after
    ``device_put`` returns, so those copies are awaited; the scatters are not): the extent may be
    freed or overwritten as soon as this returns.  At most ``max_inflight_bytes`` of Host -> Device
    copies are outstanding at once.

    Returns:
      ``(planes, report)``: the new planes dict and a :class:`TransferReport`.
    """
    host_layout, path, starts, lengths, chunks, pages = _plan(
        planes, layout, page_ids, arena, extent, first_page, max_chunk_bytes, path, group_singles=False
    )
    report = _report(host_layout, pages, starts.size, len(chunks), path)
    if pages == 0:
        return planes, report
    if path == "host":
        return _restore_host(planes, host_layout, chunks, _word_views(host_layout, arena, extent), first_page), report
    rows = arena.view(extent).reshape(-1, host_layout.stride)
    stride = host_layout.stride
    # The block follows the planes: committed to their device when they are committed, else placed
    # uncommitted on the default device, so the scatter's cache key never flips between calls.
    k = planes["k"]
    sharding = k.sharding if getattr(k, "committed", False) else None
    pending: collections.deque = collections.deque()
    inflight = 0
    for chunk in chunks:
        lo = first_page + chunk.logical_start
        block = to_device(arena, rows[lo : lo + chunk.pages], sharding)
        planes = _scatter_packed(planes, _starts(chunk), block, host_layout=host_layout, n=chunk.length)
        pending.append((block, chunk.pages * stride))
        inflight += chunk.pages * stride
        while inflight > max_inflight_bytes and len(pending) > 1:
            done, nbytes = pending.popleft()
            done.block_until_ready()
            inflight -= nbytes
    jax.block_until_ready([b for b, _ in pending])
    return planes, report


_STAGING_SLOTS = 4


def _restore_host(planes, host_layout, chunks, views, first_page) -> dict:
    """CPU planes: stage each chunk in a reused private buffer (device plane order), then scatter.

    The runtime may wrap a numpy argument in place, so the blocks handed to the scatter are private
    staging buffers, never the extent.  A small ring of them is reused (fresh allocations would
    page-fault on every chunk); a slot is refilled only after the scatter that read it has run.
    The ring is local to the call and released by the last scatter that read it.
    """
    axis = host_layout.layout.order.page_axis
    cap = max(c.pages for c in chunks)
    ring = [
        {name: np.empty(cap * int(np.prod(v.shape[1:])), v.dtype) for name, v in views.items()}
        for _ in range(min(_STAGING_SLOTS, len(chunks)))
    ]
    tokens: list = [None] * len(ring)
    for i, chunk in enumerate(chunks):
        slot = i % len(ring)
        if tokens[slot] is not None:
            tokens[slot].block_until_ready()
        lo = first_page + chunk.logical_start
        blocks = {}
        for name, v in views.items():
            run = np.moveaxis(v[lo : lo + chunk.pages], 0, axis)
            staged = ring[slot][name][: run.size].reshape(run.shape)
            copy_blocks(staged, run)
            blocks[name] = staged
        planes, tokens[slot] = _scatter_words(planes, _starts(chunk), blocks, axis=axis, n=chunk.length)
    return planes
