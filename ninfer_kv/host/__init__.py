"""Host replica tier: a startup-fixed host arena, packed Host page layouts and page transfers.

* :class:`HostKVArena` — one fixed host buffer shared by every pool, with a bounded best-fit
  extent allocator (:class:`ExtentAllocator`), byte-exact occupancy and whole-recipe plan
  validation.
* :class:`HostKVPageLayout` — the packed, logical-order byte layout of one pool's Host pages.
* :func:`offload_pages` / :func:`restore_pages` — Device <-> Host copies of whole pages, run by run
  over adjacent physical IDs (:func:`coalesce_runs`).
"""

from .arena import HostKVArena, select_memory_kind
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
from .host_layout import HostKVPageLayout, HostPageSegment
from .runs import TransferChunk, check_page_ids, coalesce_runs, split_runs
from .transfer import TRANSFER_PATHS, TransferReport, host_layout_of, offload_pages, restore_pages

__all__ = [
    "HostKVArena",
    "select_memory_kind",
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
    "TRANSFER_PATHS",
    "TransferReport",
    "host_layout_of",
    "offload_pages",
    "restore_pages",
]
