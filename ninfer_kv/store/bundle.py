"""Handles and bundles: how callers name sequences and checkpoints.

``SequenceHandle`` (an active sequence) and ``CheckpointHandle`` (a retained, inactive continuation)
are opaque ``(id, generation)`` pairs tied to one store.  Ids are recycled; the generation advances
every time an id is freed, so a handle used after its sequence finished (a double finish) or after
its checkpoint was released is detected as stale instead of silently naming a newer object.

``SequenceKVBundle`` is what one active sequence holds: the Main Text address space plus the
selected speculative method's address space (MTP or Draft Full) when that pool is enabled, all on one execution
row.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping

from ..schema.kinds import PoolKind
from .address_space import KVAddressSpace
from ..schema.errors import StaleHandleError

__all__ = ["SequenceHandle", "CheckpointHandle", "SequenceKVBundle", "CheckpointInfo", "HandleRegistry"]

_STORE_SERIAL = itertools.count(1)


def next_store_serial() -> int:
    return next(_STORE_SERIAL)


@dataclasses.dataclass(frozen=True)
class SequenceHandle:
    """An active sequence of one store (opaque)."""

    id: int
    generation: int
    store: int = dataclasses.field(default=0, repr=False)


@dataclasses.dataclass(frozen=True)
class CheckpointHandle:
    """A retained inactive continuation of one store (opaque)."""

    id: int
    generation: int
    store: int = dataclasses.field(default=0, repr=False)


@dataclasses.dataclass(frozen=True)
class SequenceKVBundle:
    """The address spaces of one active sequence: Main plus the speculative pool's, on one row."""

    handle: SequenceHandle
    row: int
    spaces: Mapping[PoolKind, KVAddressSpace]

    @property
    def main(self) -> KVAddressSpace:
        """The Main Text address space."""
        return self.spaces[PoolKind.MAIN]

    @property
    def speculative(self) -> KVAddressSpace | None:
        """The speculative pool's address space (MTP or Draft Full), or ``None`` without a speculative pool."""
        for kind, space in self.spaces.items():
            if kind is not PoolKind.MAIN:
                return space
        return None


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a retained checkpoint holds.

    Attributes:
      frontiers: committed frontier per pool (the checkpoint's coverage).
      state_image: the opaque model state token retained with the KV (``None`` when none was given).
      reusable: whether activation may resume from it: every enabled pool is present and, when the
        store requires one, a state image is held.  KV pages alone are never a reusable hit.
      spaces: the inactive address spaces per pool.
      placement: where the pages have replicas, over every pool: ``"device"`` (some page has no
        valid Host replica), ``"host"`` (every page has a valid Host replica and some page has no
        Device replica: an activation restores it) or ``"both"`` (every page has both).  A
        checkpoint mixing Device-only and Host-only pages reads ``"device"``; ``page_placement``
        has the exact counts.
      page_placement: pages per placement over every pool: ``{"device": n, "host": n, "both": n}``
        (Device-only, Host-only, Both).
    """

    handle: CheckpointHandle
    frontiers: Mapping[PoolKind, int]
    state_image: Any
    reusable: bool
    spaces: Mapping[PoolKind, KVAddressSpace]
    placement: str = "device"
    page_placement: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Record:
    kind: str  # "sequence" | "checkpoint"
    slots: dict  # PoolKind -> space slot
    row: int = -1
    state_image: Any = None
    lost: dict | None = None  # {PoolKind: intact frontier} while quarantined by a resync


class HandleRegistry:
    """Id + generation bookkeeping for sequences and checkpoints of one store."""

    def __init__(self, store_serial: int):
        self.store = store_serial
        self._records: list[_Record | None] = []
        self._gens: list[int] = []
        self._free: list[int] = []

    def add(self, record: _Record):
        if self._free:
            i = self._free.pop()
            self._records[i] = record
        else:
            i = len(self._records)
            self._records.append(record)
            self._gens.append(0)
        cls = SequenceHandle if record.kind == "sequence" else CheckpointHandle
        return cls(i, self._gens[i], self.store)

    def undo_add(self, handle) -> None:
        """Exact inverse of the last :meth:`add` (rollback)."""
        i = handle.id
        self._records[i] = None
        if i == len(self._records) - 1 and self._gens[i] == 0:
            self._records.pop()
            self._gens.pop()
        else:
            self._free.append(i)

    def remove(self, handle) -> _Record:
        record = self.get(handle)
        self._records[handle.id] = None
        self._gens[handle.id] += 1
        self._free.append(handle.id)
        return record

    def get(self, handle) -> _Record:
        if isinstance(handle, SequenceHandle):
            kind, what = "sequence", "the sequence has already finished (finish called twice?)"
        elif isinstance(handle, CheckpointHandle):
            kind, what = "checkpoint", "the checkpoint was released or consumed by a Move activation"
        else:
            raise TypeError(f"expected a SequenceHandle or CheckpointHandle, got {type(handle).__name__}")
        if handle.store != self.store or not 0 <= handle.id < len(self._records):
            raise StaleHandleError(f"unknown {type(handle).__name__}(id={handle.id}): it does not belong to this store")
        record = self._records[handle.id]
        if self._gens[handle.id] != handle.generation or record is None or record.kind != kind:
            raise StaleHandleError(
                f"stale {type(handle).__name__}(id={handle.id}, generation={handle.generation}): {what}"
            )
        return record

    def handles(self, kind: str) -> list:
        cls = SequenceHandle if kind == "sequence" else CheckpointHandle
        return [cls(i, self._gens[i], self.store) for i, r in enumerate(self._records) if r is not None and r.kind == kind]

    def snapshot(self) -> dict:
        return {
            "records": [
                None if r is None else (r.kind, dict(r.slots), r.row, id(r.state_image), r.lost) for r in self._records
            ],
            "gens": list(self._gens),
            "free": list(self._free),
        }
