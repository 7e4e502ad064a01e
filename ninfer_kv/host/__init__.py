"""Host replica tier: a startup-fixed host arena, packed Host page layouts and page transfers.

* :class:`HostKVArena` — one fixed host buffer shared by every pool, with a bounded best-fit
  extent allocator (:class:`ExtentAllocator`), byte-exact occupancy and whole-recipe plan
  validation.
* :class:`HostKVPageLayout` — the packed, logical-order byte layout of one pool's Host pages.
* :class:`TransferReport`, :func:`coalesce_runs` — what a transfer moved, run by run over adjacent
  physical IDs.  The copies themselves (:func:`~ninfer_kv.device.host_transfer.offload_pages`,
  :func:`~ninfer_kv.device.host_transfer.restore_pages`) are device work: they live in the device
  layer.
* :func:`copy_blocks` — ``dst[...] = src`` (or a gather along the first axis) for page data, with
  streaming stores over the FFI library's threads when it is built, else numpy.

The package is host-only: it imports no JAX.  How the arena's bytes reach a device (the staging
memory kind, the copies) is the device layer's: :mod:`ninfer_kv.device.staging`.
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
from .runs import TransferChunk, check_page_ids, coalesce_runs, split_runs

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
