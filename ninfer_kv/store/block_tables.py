"""Block-table matrices: the store's copy of one pool's ``int32 (C, L)`` matrix and its pending updates.

Entry ``[r, b]`` is the pool-local physical page ID of logical block ``b`` of the address
space leased to execution row ``r``.  Entries no active membership covers — unmapped blocks, the
rows of finished sequences, idle rows — hold :data:`SENTINEL_PAGE` (``-1``), an ID outside
``[0, N)`` of every pool.  Every op implementation drops such an entry under ``jax.jit`` (its
appended tokens are dropped, its keys are invisible), so a step over a stale or poisoned table can
lose that step's tokens but never read or write a page another sequence owns.

The store's copy is the truth; writes mark entries dirty.  :meth:`BlockTableMatrix.take` hands every
dirty entry out as a fixed-shape update buffer — ``int32 (3, U)`` (row, block, page) triples, ``U``
from a fixed ladder of buckets (:data:`PUBLISH_BUCKETS` up to ``C * L``), padded with the
out-of-range row ``C`` that the device scatter drops — for :func:`~ninfer_kv.apply_work` to apply
to the caller's device matrix.  Publication never recompiles a step (one compilation per bucket)
and never reallocates the matrix.  The store holds no device array.

Every take builds fresh numpy arrays; nothing handed out is mutated afterwards.
"""

from __future__ import annotations

import numpy as np

from ..schema.geometry import SENTINEL_PAGE
from ..schema.buckets import bucket

__all__ = ["BlockTableMatrix", "PUBLISH_BUCKETS"]


PUBLISH_BUCKETS: tuple[int, ...] = (64, 512, 4096, 32768)
"""Update-buffer lengths below ``C * L`` (plus 0 and ``C * L`` itself)."""


class BlockTableMatrix:
    """The store's copy (:attr:`entries`) and pending updates of one pool's block tables.

    Args:
      rows: execution rows C.
      logical_pages: logical blocks L per address space.
    """

    SENTINEL = SENTINEL_PAGE

    def __init__(self, rows: int, logical_pages: int):
        self.rows = int(rows)
        self.logical_pages = int(logical_pages)
        self.entries = np.full((self.rows, self.logical_pages), self.SENTINEL, np.int32)
        self._dirty: list[np.ndarray] = []
        cap = self.rows * self.logical_pages
        self.buckets = tuple(sorted({0, cap, *(b for b in PUBLISH_BUCKETS if b < cap)}))

    # -- writes -----------------------------------------------------------------------------------------
    def write(self, rows: np.ndarray, blocks: np.ndarray, pages) -> None:
        """Set entries ``[rows[i], blocks[i]] = pages[i]`` (distinct pairs) and mark them dirty."""
        self.entries[rows, blocks] = pages
        self._dirty.append(rows * self.logical_pages + blocks)

    def write_row(self, row: int, pages: np.ndarray) -> None:
        """Set row ``row`` to ``pages`` followed by sentinels."""
        n = pages.size
        self.entries[row, :n] = pages
        self.entries[row, n:] = self.SENTINEL
        self._dirty.append(np.arange(row * self.logical_pages, (row + 1) * self.logical_pages, dtype=np.int64))

    def clear_row(self, row: int) -> None:
        """Set every entry of ``row`` to the sentinel (an idle or quarantined row)."""
        self.write_row(row, np.zeros(0, np.int32))

    def mark_all(self) -> None:
        """Mark every entry dirty: the next :meth:`take` republishes the whole matrix (a resync)."""
        self._dirty = [np.arange(self.rows * self.logical_pages, dtype=np.int64)]

    # -- rollback support -------------------------------------------------------------------------------
    def save_row(self, row: int) -> tuple[int, np.ndarray]:
        return len(self._dirty), self.entries[row].copy()

    def restore_row(self, row: int, saved: tuple[int, np.ndarray]) -> None:
        n, values = saved
        self.entries[row] = values
        del self._dirty[n:]

    # -- pending updates ----------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Distinct dirty entries waiting for :meth:`take` (the table updates of the next take)."""
        if len(self._dirty) == 1:
            return int(self._dirty[0].size)  # one write: its (row, block) pairs are distinct
        return int(self.pending_keys().size)

    def pending_keys(self) -> np.ndarray:
        if not self._dirty:
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate(self._dirty))

    def take(self) -> np.ndarray:
        """Every dirty entry as a fresh ``int32 (3, U)`` update buffer (``U`` bucketed); clears them."""
        dirty = self._dirty
        self._dirty = []
        if not dirty:
            keys = np.zeros(0, np.int64)
        elif len(dirty) == 1:
            keys = dirty[0]  # one write: its (row, block) pairs are distinct
        else:
            keys = np.unique(np.concatenate(dirty))
        L = self.logical_pages
        n = keys.size
        u = bucket(n, self.buckets)
        updates = np.empty((3, u), np.int32)
        updates[0, n:] = self.rows  # out of range: dropped
        updates[1:, n:] = 0
        updates[0, :n] = keys // L
        updates[1, :n] = keys % L
        updates[2, :n] = self.entries.reshape(-1)[keys]
        return updates

    def snapshot(self) -> dict:
        return {"entries": self.entries.copy(), "pending": self.pending_keys()}
