"""Block-table matrices: a host mirror and a device ``int32 (C, L)`` matrix per pool.

Entry ``[r, b]`` is the pool-local physical page-group ID of logical block ``b`` of the address
space leased to execution row ``r``.  Entries no active membership covers hold the sentinel ID 0: a
valid page ID that consumers never read (their read domain ends at the valid frontier).

The host mirror is the truth; writes mark entries dirty.  :meth:`BlockTableMatrix.publish` sends
every dirty entry to the device with one jitted, *donated* scatter of a fixed-shape update buffer —
``int32 (3, U)`` (row, block, page) triples, ``U`` from a few fixed buckets, padded with an
out-of-range row that the scatter drops — so publication never recompiles (one compilation per bucket and matrix
shape) and never reallocates the matrix.

Every publication builds fresh numpy inputs; nothing handed to the device is mutated afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BlockTableMatrix", "PUBLISH_BUCKETS", "publish_table_updates"]

PUBLISH_BUCKETS: tuple[int, ...] = (64, 1024, 16384)
"""Fixed update-buffer lengths; larger publications loop over chunks of the largest bucket."""


def _scatter_updates(table: jax.Array, updates: jax.Array) -> jax.Array:
    rows, blocks, pages = updates[0], updates[1], updates[2]
    return table.at[rows, blocks].set(pages, mode="drop")


publish_table_updates = jax.jit(_scatter_updates, donate_argnums=(0,))
"""``(table, updates) -> table``: scatter ``updates = int32 (3, U)`` rows/blocks/pages into a donated
table; entries whose row is out of range (``== C``) are dropped."""


def _bucket(n: int) -> int:
    for b in PUBLISH_BUCKETS:
        if n <= b:
            return b
    return PUBLISH_BUCKETS[-1]


class BlockTableMatrix:
    """Host mirror + device matrix of one pool's block tables.

    Args:
      rows: execution rows C.
      logical_pages: logical blocks L per address space.
      device: optional device for the matrix.
    """

    SENTINEL = 0

    def __init__(self, rows: int, logical_pages: int, *, device=None):
        self.rows = int(rows)
        self.logical_pages = int(logical_pages)
        self.host = np.full((self.rows, self.logical_pages), self.SENTINEL, np.int32)
        table = jnp.full((self.rows, self.logical_pages), self.SENTINEL, jnp.int32)
        self._device = jax.device_put(table, device) if device is not None else table
        self._dirty: list[np.ndarray] = []

    # -- host writes ------------------------------------------------------------------------------------
    def write(self, rows: np.ndarray, blocks: np.ndarray, pages) -> None:
        """Set entries ``[rows[i], blocks[i]] = pages[i]`` (distinct pairs) and mark them dirty."""
        self.host[rows, blocks] = pages
        self._dirty.append(rows * self.logical_pages + blocks)

    def write_row(self, row: int, pages: np.ndarray) -> None:
        """Set row ``row`` to ``pages`` followed by sentinels."""
        n = pages.size
        self.host[row, :n] = pages
        self.host[row, n:] = self.SENTINEL
        self._dirty.append(np.arange(row * self.logical_pages, (row + 1) * self.logical_pages, dtype=np.int64))

    def clear_row(self, row: int) -> None:
        self.write_row(row, np.zeros(0, np.int32))

    # -- rollback support -------------------------------------------------------------------------------
    def save_row(self, row: int) -> tuple[int, np.ndarray]:
        return len(self._dirty), self.host[row].copy()

    def restore_row(self, row: int, saved: tuple[int, np.ndarray]) -> None:
        n, values = saved
        self.host[row] = values
        del self._dirty[n:]

    # -- device -----------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Dirty entries (with repeats) waiting for :meth:`publish`."""
        return sum(int(d.size) for d in self._dirty)

    def pending_keys(self) -> np.ndarray:
        if not self._dirty:
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate(self._dirty))

    @property
    def device(self) -> jax.Array:
        """The device matrix as of the last :meth:`publish`."""
        return self._device

    def publish(self) -> jax.Array:
        """Send every dirty entry to the device (batched, donated); returns the device matrix."""
        if not self._dirty:
            return self._device
        dirty = self._dirty
        self._dirty = []
        if len(dirty) == 1:
            keys = dirty[0]  # one write: its (row, block) pairs are distinct
        else:
            keys = np.unique(np.concatenate(dirty))
        L = self.logical_pages
        values = self.host.reshape(-1)[keys]
        n = keys.size
        table = self._device
        start = 0
        while start < n:
            u = _bucket(n - start)
            take = min(u, n - start)
            chunk = keys[start : start + take]
            updates = np.zeros((3, u), np.int32)  # fresh every time: never mutated once handed over
            updates[0, take:] = self.rows  # out of range: dropped
            updates[0, :take] = chunk // L
            updates[1, :take] = chunk % L
            updates[2, :take] = values[start : start + take]
            table = publish_table_updates(table, updates)
            start += take
        self._device = table
        return table

    def snapshot(self) -> dict:
        return {"host": self.host.copy(), "device": np.asarray(self._device).copy(), "pending": self.pending_keys()}
