"""FrontierHistory: how far each address space's committed content had reached at each recent take.

A device state that missed works (skipped, repeated, reordered, or a blank replacement state) holds
the content of the works it applied and of the steps that ran over them, and nothing after.  The
store never sees the device, so to repair such a state (:func:`~ninfer_kv.resync`) it must *date*
its own bookkeeping: which committed tokens were appended by steps the state really ran.

Epochs.  The store is in epoch ``e`` between take ``e - 1`` and take ``e`` (``store.work_serial ==
e``).  A step applies the work it was given and appends; the caller commits afterwards, in the same
epoch.  So the commits of epoch ``e`` are the appends of the step that applied work ``e - 1``, and a
state that applied works ``0 .. s - 1`` in order holds every token committed in epochs ``<= s``.

This table keeps, per pool:

* ``ring[e % window]``: every execution row's committed frontier at take ``e`` (the last
  ``window`` takes), so the frontier a row had reached at any recent epoch is one lookup;
* ``changed[row]``: the epoch of the row's last frontier advance (content older than any recent
  epoch needs no ring entry);
* per retained checkpoint: the same two facts of the row it came from, frozen at ``finish``, so a
  checkpoint (and any sequence activated from it) is dated like the sequence that wrote it.

Frontiers only grow between truncations; a truncation lowers the row's ring column to the new
frontier.  Beyond the window nothing is known and :meth:`intact` answers 0 (conservative: a repair
then restores that content from a valid Host replica where one exists, and treats the rest as lost).  Every method is O(rows) or O(window); :meth:`record_take`
runs once per take.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["FrontierHistory", "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 256
"""Takes a state may lag behind its store and still be repaired without treating recent content as lost."""


@dataclasses.dataclass(frozen=True)
class _Dated:
    """A retained checkpoint's dating: retained at epoch ``retained``, last advanced at ``changed``,
    frontier ``frontier``, ring column ``column`` (takes ``retained - window .. retained - 1``)."""

    retained: int
    changed: int
    frontier: int
    column: np.ndarray


class FrontierHistory:
    """Dated committed frontiers of one pool's execution rows and checkpoints (see module docstring)."""

    def __init__(self, rows: int, window: int = DEFAULT_WINDOW):
        self.rows = int(rows)
        self.window = max(int(window), 1)
        self.ring = np.zeros((self.window, self.rows), np.int64)
        self.takes = 0
        self.changed = np.full(self.rows, -1, np.int64)
        self.checkpoints: dict[int, _Dated] = {}

    # -- transitions --------------------------------------------------------------------------------
    def record_take(self, committed_rows: np.ndarray) -> None:
        """Take number ``self.takes`` happens now, with these row frontiers."""
        self.ring[self.takes % self.window] = committed_rows
        self.takes += 1

    def record_commit(self, rows: np.ndarray, advanced: np.ndarray) -> None:
        """Rows ``rows[advanced]`` advanced their frontier in the current epoch."""
        if advanced.all():
            self.changed[rows] = self.takes
        elif advanced.any():
            self.changed[rows[advanced]] = self.takes

    def save_rows(self, rows: np.ndarray) -> np.ndarray:
        return self.changed[rows].copy()

    def restore_rows(self, rows: np.ndarray, saved: np.ndarray) -> None:
        self.changed[rows] = saved

    def record_truncate(self, row: int, frontier: int) -> None:
        """Row ``row``'s frontier fell to ``frontier``: no earlier take saw more of its content."""
        np.minimum(self.ring[:, row], frontier, out=self.ring[:, row])

    def record_activation(self, row: int, frontier: int, source: int | None) -> None:
        """Row ``row`` starts at ``frontier`` tokens carried from checkpoint slot ``source`` (``None``:
        the root, nothing carried)."""
        if source is None:
            self.ring[:, row] = 0
            self.changed[row] = -1
            return
        dated = self.checkpoints[source]
        self.ring[:, row] = np.minimum(frontier, self._series(dated, self._ring_epochs()))
        self.changed[row] = dated.changed

    def record_retain(self, row: int, slot: int, frontier: int) -> None:
        """Row ``row`` became checkpoint slot ``slot`` at frontier ``frontier`` (now)."""
        self.checkpoints[slot] = _Dated(self.takes, int(self.changed[row]), int(frontier), self.ring[:, row].copy())

    def record_release(self, slot: int) -> None:
        self.checkpoints.pop(slot, None)

    # -- queries --------------------------------------------------------------------------------------
    def _ring_epochs(self) -> np.ndarray:
        """The take each ring index holds (``-1`` where no take happened yet)."""
        i = np.arange(self.window)
        last = self.takes - 1
        e = last - ((last - i) % self.window)
        return np.where(e >= 0, e, -1)

    def _series(self, dated: _Dated, epochs: np.ndarray) -> np.ndarray:
        """A checkpoint's frontier at takes ``epochs`` (0 where unknown)."""
        known = epochs >= dated.retained - self.window
        before = np.where(known, dated.column[epochs % self.window], 0)
        return np.where(epochs >= dated.retained, dated.frontier, before)

    def intact_row(self, row: int, committed: int, epoch: int) -> int:
        """The frontier row ``row`` (now at ``committed``) had reached when epoch ``epoch`` ended:
        everything if it has not advanced since, the ring's record if that take is recent, else 0."""
        if self.changed[row] <= epoch:
            return committed
        if 0 <= epoch and self.takes - self.window <= epoch < self.takes:
            return min(committed, int(self.ring[epoch % self.window, row]))
        return 0

    def intact_checkpoint(self, slot: int, committed: int, epoch: int) -> int:
        """The same for a retained checkpoint (its frontier is ``committed``)."""
        dated = self.checkpoints.get(slot)
        if dated is None:
            return 0
        if dated.changed <= epoch:
            return committed
        if epoch < 0:
            return 0
        return min(committed, int(self._series(dated, np.array([epoch]))[0]))

    def snapshot(self) -> dict:
        return {
            "ring": self.ring.copy(),
            "takes": self.takes,
            "changed": self.changed.copy(),
            "checkpoints": {
                k: (d.retained, d.changed, d.frontier, d.column.tolist()) for k, d in sorted(self.checkpoints.items())
            },
        }
