"""Device <-> Host page transfers (defined in :mod:`ninfer_kv.device.host_transfer`, the device
layer; re-exported here under their original module)."""

from __future__ import annotations

from ..device.host_transfer import TRANSFER_PATHS, offload_pages, restore_pages
from .host_layout import TransferReport, host_layout_of

__all__ = ["TRANSFER_PATHS", "TransferReport", "host_layout_of", "offload_pages", "restore_pages"]
