"""Repairing a device state that missed round works: the dating rule and the report.

A :class:`~ninfer_kv.KVDeviceState` can fall out of line with its store in three ways: it is
**poisoned** (a work was skipped, repeated or reordered: :func:`~ninfer_kv.apply_work` detected
it and has dropped every op since), it **lags** (works were taken and never applied), or it is
**blank** (allocated after works were taken, e.g. to replace a state lost with a failed donated
step).  :func:`~ninfer_kv.resync` repairs any of them without rebuilding the store:

1. the state's ``(serial, fault)`` says how far it got: the works it applied in order and so the
   epochs whose commits it holds (:func:`dated_epoch`);
2. every pool rates each page by the columns that are correct once the repair is applied, replays
   the page writes the state missed whose source still exists (a Host replica still held, or a
   COW source page still live, read on the device or from its Host replica) and reports the
   address spaces whose committed content no source can restore
   (:meth:`~ninfer_kv.store.runtime.PoolRuntime.plan_resync`).  A Device page holds what the
   dating gives it, all of it once restored from a Host replica; a Host-only page holds what its
   Host replica holds (nothing on the device to repair: an activation restores it); a COW
   destination replayed in full holds the copied columns and, beyond them, what the dating gives
   it;
3. the sequences and checkpoints holding such spaces are **quarantined** (never silently served:
   their rows are inert on the device, every verb refuses them with
   :class:`~ninfer_kv.schema.errors.LostContentError` except ``finish(retain=False)``,
   ``release_checkpoint`` and ``truncate`` back to the reported intact frontier);
4. one work republishes every block table and carries the replays; the state's serial is reset to
   it and the work applied, so the state equals the store again;
5. offload plans in flight are cancelled (their pages unpinned, their extents freed): a payload
   gathered before the repair proves nothing about the repaired content.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..schema.kinds import PoolKind
from ..schema.round_work import BLANK, SyncStatus

__all__ = ["ResyncReport", "dated_epoch"]


def dated_epoch(status: SyncStatus) -> int:
    """The last epoch whose commits a state with ``status`` holds.

    A state that applied works ``0 .. s - 1`` holds the commits of epochs ``<= s`` (the appends of the
    step that applied work ``s - 1`` are committed in epoch ``s``), unless the slip was a repeat of
    an older work or a work of another store: the step that applied it may have run in epoch ``s``
    already, so only epochs ``< s`` are sure.  A blank state holds nothing.
    """
    if not status.poisoned:
        return status.applied
    if status.offending == BLANK:
        return -1
    foreign = status.offending_store not in (None, 0, status.owner) and status.owner != 0
    if foreign or (status.offending is not None and 0 <= status.offending < status.applied):
        return status.applied - 1
    return status.applied


@dataclasses.dataclass(frozen=True)
class ResyncReport:
    """What :func:`~ninfer_kv.resync` found and did.

    Attributes:
      applied: works the state had applied in order before the repair.
      serial: the store's work serial after the repair (the repaired state's serial).
      lost_sequences: quarantined active sequences, each with ``{PoolKind: intact frontier}`` (the
        tokens the device still holds; ``truncate`` to it returns the sequence to service).
      lost_checkpoints: quarantined checkpoints with the same mapping (release them).
      replayed: ``{PoolKind: (COW copies, Host restores)}`` replayed into the state.
      cancelled_offloads: offload plans that were in flight, cancelled (a payload gathered before the
        repair proves nothing; plan them again).
    """

    applied: int
    serial: int
    lost_sequences: Mapping = dataclasses.field(default_factory=dict)
    lost_checkpoints: Mapping = dataclasses.field(default_factory=dict)
    replayed: Mapping[PoolKind, tuple[int, int]] = dataclasses.field(default_factory=dict)
    cancelled_offloads: int = 0

    @property
    def lost(self) -> tuple:
        """Every quarantined handle: sequences, then checkpoints."""
        return tuple(self.lost_sequences) + tuple(self.lost_checkpoints)

    @property
    def clean(self) -> bool:
        """Nothing was lost."""
        return not self.lost_sequences and not self.lost_checkpoints
