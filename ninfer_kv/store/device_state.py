"""KVDeviceState (defined in :mod:`ninfer_kv.device.state`, the device layer; re-exported here
under its original module)."""

from __future__ import annotations

from ..device.state import BLANK, POISONED, KVDeviceState, SyncStatus, check_live

__all__ = ["KVDeviceState", "POISONED", "BLANK", "SyncStatus", "check_live"]
