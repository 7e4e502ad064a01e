"""KV ops over a device mesh (defined in :mod:`ninfer_kv.device.sharded_ops`, the device layer;
re-exported here under their original module)."""

from __future__ import annotations

from .device.sharded_ops import (
    local_rows,
    sharded_apply_work,
    sharded_gather_pages,
    sharded_paged_append,
    sharded_paged_attention,
)

__all__ = ["sharded_apply_work", "sharded_gather_pages", "sharded_paged_append", "sharded_paged_attention",
           "local_rows"]
