"""ColumnTable: the struct-of-arrays base of the store's slot tables.

A table declares its columns once — name, dtype, the value of a fresh or cleared slot, and an
optional trailing shape — and inherits growing them (:meth:`ColumnTable.grow_columns`), resetting
slots to their fresh values (:meth:`ColumnTable.reset_columns`) and a comparable copy
(:meth:`ColumnTable.column_snapshot`).  The table's own methods remain its only transitions; the
base holds no policy (slot free lists, generations, invariants stay in each table).

A column with ``dtype=object`` is a Python list (for handles such as Host extents).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

__all__ = ["Column", "ColumnTable"]


class Column:
    """One column of a :class:`ColumnTable`: ``dtype``, the ``fill`` of a fresh slot, and a trailing
    ``shape`` per slot (``()``: a scalar per slot)."""

    __slots__ = ("dtype", "fill", "shape")

    def __init__(self, dtype, fill, shape: tuple = ()):
        self.dtype = dtype
        self.fill = fill
        self.shape = tuple(shape)


class ColumnTable:
    """Base of a struct-of-arrays table whose rows are slots ``0 .. capacity - 1``.

    Subclasses set :attr:`COLUMNS` (``{name: Column}``) and call :meth:`init_columns` once, then
    :meth:`grow_columns` to add slots.  Column trailing shapes may name an attribute of the table
    (a string entry), read at :meth:`init_columns` time.
    """

    COLUMNS: ClassVar[dict[str, Column]] = {}
    capacity: int = 0

    def _shape(self, column: Column) -> tuple:
        return tuple(getattr(self, d) if isinstance(d, str) else int(d) for d in column.shape)

    def init_columns(self) -> None:
        """Create every column with no slot."""
        self.capacity = 0
        for name, col in self.COLUMNS.items():
            if col.dtype is object:
                setattr(self, name, [])
            else:
                setattr(self, name, np.zeros((0,) + self._shape(col), col.dtype))

    def grow_columns(self, capacity: int) -> int:
        """Extend every column to ``capacity`` slots, new slots fresh; returns how many were added."""
        n = int(capacity) - self.capacity
        if n <= 0:
            return 0
        for name, col in self.COLUMNS.items():
            cur = getattr(self, name)
            if col.dtype is object:
                cur.extend([col.fill] * n)
            else:
                fresh = np.full((n,) + self._shape(col), col.fill, col.dtype)
                setattr(self, name, np.concatenate([cur, fresh]))
        self.capacity = int(capacity)
        return n

    def reset_columns(self, slots, names=None) -> None:
        """Set ``slots`` of the columns ``names`` (default: every column) to their fresh values."""
        for name in self.COLUMNS if names is None else names:
            col = self.COLUMNS[name]
            cur = getattr(self, name)
            if col.dtype is object:
                for s in np.atleast_1d(np.asarray(slots)).tolist():
                    cur[s] = col.fill
            else:
                cur[slots] = col.fill

    def column_snapshot(self, names=None) -> dict:
        """Copies of the columns ``names`` (default: every column), for comparisons."""
        out = {}
        for name in self.COLUMNS if names is None else names:
            cur = getattr(self, name)
            out[name] = list(cur) if self.COLUMNS[name].dtype is object else cur.copy()
        return out
