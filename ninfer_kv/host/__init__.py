"""Host replica tier: a startup-fixed host arena, packed Host page layouts and page transfers.

One module per job:

* :mod:`ninfer_kv.host.arena` — :class:`HostKVArena`, one fixed host buffer shared by every pool
  (the arena's bytes), and :func:`~ninfer_kv.host.arena.aligned_empty`;
* :mod:`ninfer_kv.host.extent_allocator` — the bounded best-fit :class:`ExtentAllocator` over the
  arena, with byte-exact occupancy and whole-recipe plan validation;
* :mod:`ninfer_kv.host.host_layout` — :class:`HostKVPageLayout`, the packed, logical-order byte
  layout of one pool's Host pages, and :class:`TransferReport`, what one transfer moved;
* :mod:`ninfer_kv.host.page_id_runs` — :func:`coalesce_runs` / :func:`split_runs`: physical page IDs
  as runs of adjacent IDs, cut into power-of-two copies (:class:`TransferChunk`);
* :mod:`ninfer_kv.host.block_copy` — :func:`copy_blocks`, ``dst[...] = src`` (or a gather along
  the first axis) for page data, with streaming stores over the FFI library's threads when it is
  built, else numpy;
* :mod:`ninfer_kv.host.ffi_library` — finding and loading the native library with ctypes.

The copies between device arrays and the arena (:func:`~ninfer_kv.device.host_copies.offload_pages`,
:func:`~ninfer_kv.device.host_copies.restore_pages`) and the memory kind they stage through
(:mod:`ninfer_kv.device.host_staging`) are device work: they live in the device layer.  The
store's bookkeeping of the replicas is :mod:`ninfer_kv.store.host_tier`.

The package is plain Python and numpy: it imports no JAX.
"""

from .arena import HostKVArena
from .block_copy import copy_blocks
from .extent_allocator import (
    ExtentAllocationError,
    ExtentAllocator,
    ExtentOccupancy,
    ExtentPlan,
    HostExtent,
    InvalidPlanError,
    StaleExtentError,
    TagOccupancy,
)
from .host_layout import HostKVPageLayout, HostPageSegment, TransferReport, host_layout_of
from .page_id_runs import TransferChunk, check_page_ids, coalesce_runs, split_runs

__all__ = [
    "HostKVArena",
    "copy_blocks",
    "ExtentAllocator",
    "ExtentAllocationError",
    "ExtentOccupancy",
    "ExtentPlan",
    "HostExtent",
    "InvalidPlanError",
    "StaleExtentError",
    "TagOccupancy",
    "HostKVPageLayout",
    "HostPageSegment",
    "TransferChunk",
    "check_page_ids",
    "coalesce_runs",
    "split_runs",
    "TransferReport",
    "host_layout_of",
]
