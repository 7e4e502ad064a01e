"""HostKVArena: one startup-fixed host buffer for the Host replicas of every pool.

Storage.  A JAX array is immutable, so the arena's canonical storage is a numpy ``uint8`` buffer
of the fixed capacity, aligned to a 4096-byte host page and touched once at startup (``prefault``)
so that neither page faults nor a late out-of-memory can happen inside a transfer.  Device -> Host
copies land in it and Host -> Device copies read from it.  Main and speculative pools share the
buffer; each extent carries the tag of its pool and is sized by that pool's
:class:`~ninfer_kv.host.host_layout.HostKVPageLayout`, so extents of different strides sit side by
side.  Extents are managed by :class:`~ninfer_kv.host.extent_allocator.ExtentAllocator` (best fit
with coalescing, byte-exact accounting, generation-checked handles, whole-recipe plan validation).

Staging.  The arena records which device its transfers serve and how they should stage
(``staging``: ``"auto"``, ``"pinned_host"`` or ``"direct"``); the transfers themselves, and the
choice of the memory kind they stage through, are device work:
:mod:`ninfer_kv.device.host_staging`.  This module imports no JAX.

The arena is not thread-safe; one thread owns it.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np

from ..schema.sizes import ByteSize, byte_count
from .extent_allocator import ExtentAllocator, ExtentOccupancy, ExtentPlan, HostExtent

__all__ = ["HostKVArena", "HOST_BUFFER_ALIGNMENT", "STAGING_MODES", "aligned_empty"]

HOST_BUFFER_ALIGNMENT = 4096
"""Alignment of the arena buffer's base address (one host page)."""

STAGING_MODES = ("auto", "pinned_host", "direct")
"""The values of :attr:`HostKVArena.staging`."""


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


def _advise_huge_pages(buf: np.ndarray) -> None:
    """Asks Linux to back ``buf`` (2 MiB aligned) with transparent huge pages: a fresh buffer then
    takes one page fault per 2 MiB instead of one per 4 KiB, which is most of what first touching
    a large staging buffer costs.  A no-op elsewhere or when the kernel refuses (THP ``never``)."""
    libc = _libc()
    if libc is not None:
        libc.madvise(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(buf.nbytes), _MADV_HUGEPAGE)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def _aligned_buffer(nbytes: int, alignment: int) -> np.ndarray:
    huge = nbytes >= 2 * _HUGE_PAGE
    if huge:  # whole huge pages: the buffer starts and ends on 2 MiB boundaries
        alignment = max(alignment, _HUGE_PAGE)
        nbytes_alloc = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    else:
        nbytes_alloc = nbytes
    raw = np.empty(nbytes_alloc + alignment, dtype=np.uint8)
    shift = (-raw.ctypes.data) % alignment
    if huge:
        _advise_huge_pages(raw[shift : shift + nbytes_alloc])
    buf = raw[shift : shift + nbytes]
    assert buf.ctypes.data % alignment == 0
    return buf


def aligned_empty(shape: tuple, dtype, alignment: int = HOST_BUFFER_ALIGNMENT) -> np.ndarray:
    """An uninitialized C-ordered array whose data starts on an ``alignment``-byte boundary.

    A CPU device reads such host memory in place when it is passed to a jitted function (an
    unaligned numpy argument is copied first), which is what lets a staged payload cross to the
    device without a second copy.
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if not count:
        return np.empty(shape, dtype)
    return _aligned_buffer(count * dtype.itemsize, alignment).view(dtype).reshape(shape)


class HostKVArena:
    """Fixed host buffer + extent allocator shared by all pools' Host replicas.

    Args:
      capacity_bytes: bytes of the buffer (an integer, a whole-number float or a byte-size string
        such as ``"64MiB"``, see :mod:`ninfer_kv.schema.sizes`); rounded up to a multiple of ``alignment``.
      alignment: extent alignment (power of two, default 256 bytes).
      device: the accelerator whose transfers the arena serves (``None``: JAX's default device,
        resolved by the first transfer).
      staging: ``"auto"`` (stage through page-locked ``pinned_host`` memory on a GPU that has it),
        ``"pinned_host"`` (always; refused at the first transfer where the device lacks it) or
        ``"direct"`` (never); see :mod:`ninfer_kv.device.host_staging`.
      prefault: touch every byte at construction (default True).

    Attributes:
      device: the device the arena serves (``None``: the default device).
      staging: the requested staging (one of :data:`STAGING_MODES`).
      allocator: the :class:`~ninfer_kv.host.extent_allocator.ExtentAllocator` over the buffer.
      buffer: the arena's ``uint8 (capacity,)`` numpy buffer, its base aligned to 4096 bytes.

    Raises:
      ValueError: a capacity that is not a byte count >= 1, an alignment that is not a power of
        two, or an unknown ``staging``.
      ByteSizeTypeError: a ``capacity_bytes`` of a type that is not a byte count.
    """

    def __init__(
        self,
        capacity_bytes: ByteSize,
        *,
        alignment: int = 256,
        device=None,
        staging: str = "auto",
        prefault: bool = True,
    ):
        capacity_bytes = byte_count(capacity_bytes, "capacity_bytes", minimum=1)
        if not isinstance(alignment, (int, np.integer)) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment!r} is invalid; it must be a power of two >= 1")
        capacity = -(-capacity_bytes // alignment) * alignment
        if staging not in STAGING_MODES:
            raise ValueError(f"staging={staging!r} is invalid; allowed: {', '.join(STAGING_MODES)}")
        self.device = device
        self.staging = staging
        self.allocator = ExtentAllocator(capacity, alignment)
        self.buffer = _aligned_buffer(capacity, max(HOST_BUFFER_ALIGNMENT, int(alignment)))
        if prefault:
            self.buffer.fill(0)

    # -- allocator facade --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Bytes of the buffer: ``capacity_bytes`` rounded up to a multiple of :attr:`alignment`."""
        return self.allocator.capacity

    @property
    def alignment(self) -> int:
        """Extent alignment in bytes (a power of two): every extent starts at a multiple of it."""
        return self.allocator.alignment

    def allocate(self, nbytes: int, tag: str = "main") -> HostExtent:
        """Allocate an extent of exactly ``nbytes`` packed bytes for pool ``tag``.

        Raises :class:`~ninfer_kv.host.extent_allocator.ExtentAllocationError` (arena unchanged)
        naming the requested bytes, the largest free extent and the free bytes.
        """
        return self.allocator.allocate(nbytes, tag)

    def free(self, extent: HostExtent) -> None:
        """Free an extent; a stale handle raises :class:`StaleExtentError` (arena unchanged)."""
        self.allocator.free(extent)

    def validate_plan(self, recipe) -> ExtentPlan:
        """Prove a whole ``[("release", extent) | ("allocate", nbytes[, tag]), ...]`` recipe fits."""
        return self.allocator.validate_plan(recipe)

    def execute_plan(self, recipe) -> list[HostExtent]:
        """Validate and apply a recipe atomically; returns the extents of its allocation steps."""
        return self.allocator.execute_plan(recipe)

    def check(self, extent: HostExtent) -> None:
        """Raise :class:`StaleExtentError` unless ``extent`` is live in this arena."""
        self.allocator.check(extent)

    def occupancy(self) -> ExtentOccupancy:
        """Capacity, packed/padding/free bytes, largest free extent, counts, fragmentation, per tag."""
        return self.allocator.occupancy()

    def snapshot(self) -> tuple:
        """Hashable allocator state (the buffer's bytes are not included)."""
        return self.allocator.snapshot()

    def describe(self) -> tuple:
        """Hashable description of what the arena holds (free ranges, live extents by offset, size
        and tag), equal before and after a rolled-back allocation (:meth:`ExtentAllocator.describe`)."""
        return self.allocator.describe()

    def audit_invariants(self) -> None:
        """Verify the allocator's structure and byte accounting.

        Raises:
          AssertionError: naming the first violated invariant.
        """
        self.allocator.audit_invariants()

    # -- bytes ---------------------------------------------------------------------------------------
    def view(self, extent: HostExtent) -> np.ndarray:
        """Writable uint8 view of exactly the ``extent.nbytes`` packed bytes of a live extent."""
        self.allocator.check(extent)
        return self.buffer[extent.offset : extent.offset + extent.nbytes]

    def __repr__(self) -> str:
        occ = self.occupancy()
        return (
            f"HostKVArena(capacity={occ.capacity}, used={occ.used_bytes}, free={occ.free_bytes}, "
            f"extents={occ.extent_count}, staging={self.staging!r})"
        )
