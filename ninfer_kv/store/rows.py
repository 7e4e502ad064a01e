"""Execution rows: the row leases of a store and the one validation every row verb goes through.

An execution row ``r in [0, C)`` is the block-table row leased to one active sequence (the same row
in every pool).  Row verbs (``map``, ``commit``, ``trim``, ``settle``,
``round_boundary``) and the handle verbs (which resolve a handle to its row) accept only leased
rows; an idle row, an index outside ``[0, C)``, a negative index or a row named twice in one call
is a :class:`RowError` (a ``ValueError``) naming the row, raised before anything changes.  A row
quarantined by a resync (its sequence's content was lost) is a :class:`LostContentError`.

Index vectors accept any integer array-like (numpy arrays of any integer dtype, Python lists, JAX
arrays) and are converted to ``int64`` with an overflow check.
"""

from __future__ import annotations

import bisect

import numpy as np

from ..schema.errors import LostContentError, RowError, TargetError

__all__ = ["ExecutionRows", "as_index_vector", "as_index", "as_integer", "check_targets"]

_I64 = np.iinfo(np.int64)


def as_index_vector(name: str, values) -> np.ndarray:
    """``values`` as a 1-D ``int64`` array: any integer array-like, checked for overflow.

    Raises ``TypeError`` for non-integer elements (floats, bools, objects) and ``ValueError`` for a
    value outside the ``int64`` range or a shape that is not 1-D.
    """
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        arr = values
    else:
        try:
            arr = np.asarray(values)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a 1-D integer array: {exc}") from None
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape}")
        if arr.dtype == object:
            flat = arr.reshape(-1).tolist()
            for v in flat:
                if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                    raise TypeError(f"{name} must hold integers, got {type(v).__name__} {v!r}")
                if not _I64.min <= int(v) <= _I64.max:
                    raise ValueError(f"{name} value {int(v)} overflows int64 (allowed: {_I64.min}..{_I64.max})")
            arr = np.asarray([int(v) for v in flat], np.int64).reshape(arr.shape)
        elif arr.dtype.kind == "u":
            if arr.size and arr.dtype.itemsize >= 8 and int(arr.max()) > _I64.max:
                raise ValueError(f"{name} value {int(arr.max())} overflows int64 (allowed: 0..{_I64.max})")
            arr = arr.astype(np.int64)
        elif arr.dtype.kind == "i":
            arr = arr.astype(np.int64, copy=False)
        elif arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)  # ``[]`` parses as float64
        else:
            raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape}")
    return arr


def as_integer(name: str, value) -> int:
    """A scalar integer (Python, numpy and 0-d JAX integers accepted); ``TypeError`` for anything
    else (floats and bools included)."""
    if hasattr(value, "shape") and getattr(value, "shape", None) == () and not isinstance(value, np.generic):
        value = np.asarray(value)[()]  # a 0-d array (JAX or numpy)
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def as_index(name: str, value, low: int = 0) -> int:
    """A scalar integer ``>= low``: :func:`as_integer`, then ``ValueError`` below ``low``."""
    value = as_integer(name, value)
    if value < low:
        raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= {low}")
    return value


def check_targets(name: str, rows: np.ndarray, values, high: int) -> np.ndarray:
    """Token targets of a row verb (map targets, frontiers, kept tokens) as ``int64`` of ``rows``' length.

    The one rule of every row and handle verb: any integer array-like (``TypeError`` otherwise), one
    value per row, each in ``[0, high]`` (``high`` = the logical capacity ``L * P``); a value outside
    is a :class:`TargetError` naming the row and the value, raised before anything changes.
    """
    values = as_index_vector(name, values)
    if values.shape != rows.shape:
        raise ValueError(f"rows {rows.shape} and {name} {values.shape} must be 1-D of one length")
    if values.size and (values.min() < 0 or values.max() > high):
        bad = (values < 0) | (values > high)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TargetError(
                f"{name}[{i}] = {int(values[i])} for row {int(rows[i])} is out of range; token targets lie in [0, "
                f"{high}] (the logical capacity L * P)"
            )
    return values


class ExecutionRows:
    """The row leases of one store: ``owner[r]`` is the sequence id holding row ``r`` (``-1`` idle).

    Rows are leased lowest first.  :meth:`check` is the validation of every row verb.
    """

    def __init__(self, count: int):
        self.count = int(count)
        self.owner = np.full(self.count, -1, np.int64)
        self._free: list[int] = list(range(self.count - 1, -1, -1))  # pop() -> lowest row
        self._stamp = np.zeros(self.count, np.int64)
        self.quarantined = np.zeros(self.count, bool)
        self._any_quarantined = False
        # The last row set :meth:`check` accepted, kept until a lease or quarantine changes: a
        # decode loop names the same rows every round, and comparing them is one numpy call.
        self._checked: np.ndarray | None = None

    # -- leases ----------------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """Remove the lowest free row from the free list (not yet owned: see :meth:`lease`)."""
        return self._free.pop()

    def untake(self, row: int) -> None:
        self._free.append(row)

    def lease(self, row: int, owner: int) -> None:
        self.owner[row] = owner
        self._checked = None

    def unlease(self, row: int) -> None:
        self.owner[row] = -1
        self._checked = None

    def release(self, row: int) -> None:
        self.owner[row] = -1
        self._checked = None
        self.set_quarantined(row, False)
        bisect.insort(self._free, row, key=lambda r: -r)

    def set_quarantined(self, row: int, value: bool) -> None:
        """Mark ``row`` (not) quarantined: a quarantined row is refused by :meth:`check`."""
        self.quarantined[row] = value
        self._any_quarantined = bool(self.quarantined.any())
        self._checked = None

    def active(self) -> np.ndarray:
        return np.flatnonzero(self.owner >= 0)

    # -- validation ------------------------------------------------------------------------------------
    def check(self, rows, name: str = "rows") -> np.ndarray:
        """``rows`` as ``int64``, each a row leased to an active sequence, none twice; else a
        :class:`RowError` naming the first bad row (nothing is changed by a check)."""
        rows = as_index_vector(name, rows)
        n = rows.size
        if n == 0:
            return rows
        last = self._checked
        if last is not None and last.size == n and (last == rows).all():
            return rows  # the same rows as the last accepted call, no lease changed since
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= self.count:
            bad = int(rows[(rows < 0) | (rows >= self.count)][0])
            raise RowError(f"{name}: row {bad} is outside [0, {self.count}) (execution rows of this store)")
        idle = self.owner[rows] < 0
        if idle.any():
            bad = int(rows[idle][0])
            raise RowError(f"{name}: row {bad} is not leased to an active sequence (active rows: "
                           f"{self.active().tolist()})")
        if self._any_quarantined and self.quarantined[rows].any():
            bad = int(rows[self.quarantined[rows]][0])
            raise LostContentError(
                f"{name}: row {bad} holds a sequence whose content a resync found lost; finish it (retain=False) or "
                f"truncate it to the intact frontier the resync reported"
            )
        if n > 1:
            stamp = self._stamp
            order = np.arange(n, dtype=np.int64)
            stamp[rows] = order
            dup = stamp[rows] != order
            if dup.any():
                bad = int(rows[dup][0])
                raise RowError(f"{name}: row {bad} is named more than once in one call")
        self._checked = rows.copy()
        return rows

    def check_one(self, row: int) -> np.ndarray:
        """The one-row vector of a handle verb (same validation as :meth:`check`)."""
        return self.check(np.array([row], np.int64))

    def snapshot(self) -> dict:
        return {"free_rows": list(self._free), "row_owner": self.owner.copy(), "quarantined": self.quarantined.copy()}

    def audit_invariants(self, errors) -> None:
        active = set(self.active().tolist())
        if sorted(self._free) != sorted(set(range(self.count)) - active):
            raise errors("free execution rows disagree with leased rows")
