"""DevicePagePool: the physical page namespace of one growing pool.

A pool owns page IDs ``[0, capacity)``.  Every ID is, at every public call boundary, in
exactly one of three states, and the counts obey the capacity identity::

    allocated + reserved + available == capacity

* **allocated** — the ID is held by a :class:`DeviceKVPageLease` (it is not in the free set);
* **reserved** — a count (not specific IDs) promised to one owner (an active address space's
  execution row) that no other owner may take;
* **available** — free and unpromised.

``materialize`` turns an owner's reservation into leases; ``dematerialize`` returns leases to the
same owner's reservation; neither changes what other owners can get.  ``release`` returns leases to
the global available count.

Leases are generation-checked: each page ID carries a generation that advances every time a lease
on it is released, so a lease kept past its release (and the ID's reuse) is rejected.

The free set is a bitmap.  Small requests take the lowest free IDs (scanning from a lower-bound
hint), larger ones prefer the lowest contiguous run, so IDs tend to be handed out in runs; no
correctness property depends on contiguity.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..schema.errors import InvariantError, PoolCapacityError, StaleHandleError

__all__ = ["DeviceKVPageLease", "DevicePagePool"]

_RUN_SEARCH_MIN = 8  # requests of at least this many pages look for a contiguous run first
_SCAN_WINDOW = 256


@dataclasses.dataclass(frozen=True)
class DeviceKVPageLease:
    """Exclusive hold of one page of one pool, valid while ``generation`` is current."""

    pool: str
    page: int
    generation: int


def _as_ids(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


class DevicePagePool:
    """Page IDs ``[0, capacity)`` with reservations and generation-checked leases.

    Args:
      capacity: number of physical pages N (>= 1).
      owners: number of reservation owners (the store uses one per execution row).
      name: pool name used in error messages and leases.
    """

    def __init__(self, capacity: int, owners: int, *, name: str = "main"):
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} is invalid; it must be an integer >= 1")
        if not isinstance(owners, (int, np.integer)) or owners < 1:
            raise ValueError(f"owners={owners!r} is invalid; it must be an integer >= 1")
        self.name = str(name)
        self.capacity = int(capacity)
        self.num_owners = int(owners)
        self._free = np.ones(self.capacity, dtype=bool)
        self._free_count = self.capacity
        self._hint = 0  # lower bound of the lowest free ID
        self._gen = np.zeros(self.capacity, dtype=np.int64)
        self._res = np.zeros(self.num_owners, dtype=np.int64)
        self._reserved = 0

    # -- counts -------------------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Pages held by leases."""
        return self.capacity - self._free_count

    @property
    def reserved(self) -> int:
        """Pages promised to owners but not materialized."""
        return self._reserved

    @property
    def available(self) -> int:
        """Pages neither leased nor reserved."""
        return self._free_count - self._reserved

    def reservation(self, owner: int) -> int:
        """Pages reserved for ``owner`` and not yet materialized."""
        return int(self._res[self._owner(owner)])

    def reservations(self) -> np.ndarray:
        """A copy of every owner's reservation count."""
        return self._res.copy()

    def is_free(self, page: int) -> bool:
        """Whether page ``page`` is free (neither leased nor set aside for a reservation)."""
        return bool(self._free[self._page(page)])

    def lease(self, page: int) -> DeviceKVPageLease:
        """The current lease on ``page`` (which must be allocated)."""
        p = self._page(page)
        if self._free[p]:
            raise StaleHandleError(f"pool {self.name}: page {p} is free; it has no lease")
        return DeviceKVPageLease(self.name, p, int(self._gen[p]))

    def generations(self, pages) -> np.ndarray:
        """The lease generation of each page in ``pages`` (advanced at every release)."""
        return self._gen[_as_ids(pages)]

    # -- validation helpers -------------------------------------------------------------------------
    def _owner(self, owner) -> int:
        if not isinstance(owner, (int, np.integer)) or not 0 <= owner < self.num_owners:
            raise ValueError(f"pool {self.name}: owner={owner!r} is outside [0, {self.num_owners})")
        return int(owner)

    def _page(self, page) -> int:
        if not isinstance(page, (int, np.integer)) or not 0 <= page < self.capacity:
            raise ValueError(f"pool {self.name}: page={page!r} is outside [0, {self.capacity})")
        return int(page)

    def check_leases(self, pages, generations) -> None:
        """Raise :class:`StaleHandleError` unless every (page, generation) is a current lease."""
        ids = _as_ids(pages)
        gens = _as_ids(generations)
        if ids.shape != gens.shape:
            raise ValueError(f"pool {self.name}: {ids.size} pages but {gens.size} generations")
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= self.capacity:
            raise ValueError(f"pool {self.name}: page IDs must lie in [0, {self.capacity}), got {ids.tolist()}")
        bad = self._free[ids] | (self._gen[ids] != gens)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            p = int(ids[i])
            state = "free" if self._free[p] else f"leased at generation {int(self._gen[p])}"
            raise StaleHandleError(
                f"pool {self.name}: stale lease on page {p} (generation {int(gens[i])}); the page is now {state}"
            )

    # -- reservations ---------------------------------------------------------------------------------
    def reserve(self, owner: int, count: int) -> None:
        """Promise ``count`` available pages to ``owner``."""
        o = self._owner(owner)
        count = int(count)
        if count < 0:
            raise ValueError(f"pool {self.name}: reserve count={count} must be >= 0")
        if count > self.available:
            raise PoolCapacityError(
                f"pool {self.name}: cannot reserve {count} pages for row {o}; only {self.available} of "
                f"{self.capacity} are available ({self.allocated} allocated, {self.reserved} reserved)"
            )
        self._res[o] += count
        self._reserved += count

    def reserve_many(self, owners: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`reserve` for distinct owners (all or nothing)."""
        counts = _as_ids(counts)
        total = int(counts.sum())
        if counts.size and counts.min() < 0:
            raise ValueError(f"pool {self.name}: reserve counts must be >= 0")
        if total > self.available:
            raise PoolCapacityError(
                f"pool {self.name}: cannot reserve {total} pages; only {self.available} are available"
            )
        self._res[owners] += counts
        self._reserved += total

    def unreserve(self, owner: int, count: int) -> None:
        """Return ``count`` of ``owner``'s reserved pages to the available count."""
        o = self._owner(owner)
        count = int(count)
        if not 0 <= count <= self._res[o]:
            raise ValueError(
                f"pool {self.name}: cannot unreserve {count} pages of row {o}; it holds {int(self._res[o])}"
            )
        self._res[o] -= count
        self._reserved -= count

    def release_reservation(self, owner: int) -> int:
        """Return all of ``owner``'s reservation to the available count; returns the count."""
        o = self._owner(owner)
        count = int(self._res[o])
        self._res[o] = 0
        self._reserved -= count
        return count

    # -- free-set search ------------------------------------------------------------------------------
    def _take(self, k: int) -> np.ndarray:
        """Remove ``k`` free IDs from the free set (lowest run, else lowest IDs)."""
        if k > self._free_count:
            raise InvariantError(f"pool {self.name}: {k} pages requested but only {self._free_count} are free")
        free = self._free
        if k >= _RUN_SEARCH_MIN:
            edges = np.diff(np.concatenate(([0], free[self._hint :].view(np.int8), [0])))
            starts = np.flatnonzero(edges == 1)
            ends = np.flatnonzero(edges == -1)
            fit = np.flatnonzero(ends - starts >= k)
            if fit.size:
                s = int(starts[fit[0]]) + self._hint
                ids = np.arange(s, s + k, dtype=np.int64)
                free[s : s + k] = False
                self._free_count -= k
                if s == self._hint:
                    self._hint = s + k
                return ids
        lo = self._hint
        found = np.flatnonzero(free[lo : lo + max(_SCAN_WINDOW, 4 * k)])
        if found.size < k:
            found = np.flatnonzero(free[lo:])
        ids = found[:k] + lo
        free[ids] = False
        self._free_count -= k
        self._hint = int(ids[-1]) + 1
        return ids

    def _give_back(self, ids: np.ndarray, bump: bool) -> None:
        free = self._free
        free[ids] = True
        self._free_count += ids.size
        if bump:
            self._gen[ids] += 1
        self._hint = min(self._hint, int(ids.min()))

    # -- leases ---------------------------------------------------------------------------------------
    def materialize(self, owner: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Turn ``count`` of ``owner``'s reserved pages into leases; returns (page IDs, generations)."""
        o = self._owner(owner)
        count = int(count)
        if not 0 <= count <= self._res[o]:
            raise PoolCapacityError(
                f"pool {self.name}: row {o} asks to materialize {count} pages but its reservation holds "
                f"{int(self._res[o])}"
            )
        if count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ids = self._take(count)
        self._res[o] -= count
        self._reserved -= count
        return ids, self._gen[ids]

    def materialize_many(self, owners: np.ndarray, counts: np.ndarray, *, checked: bool = True, total: int | None = None):
        """Vectorized :meth:`materialize` for distinct owners.

        Returns page IDs and generations, ``counts[0]`` for ``owners[0]`` first, then the next owner.
        The caller guarantees the owners are distinct; ``checked=False`` also skips the reservation
        check (for callers whose own invariants guarantee it).  ``total`` is ``counts.sum()`` when the
        caller already has it.
        """
        res = self._res
        if checked and (res[owners] < counts).any():
            i = int(np.flatnonzero(res[owners] < counts)[0])
            raise PoolCapacityError(
                f"pool {self.name}: row {int(owners[i])} asks to materialize {int(counts[i])} pages but its "
                f"reservation holds {int(res[owners[i]])}"
            )
        k = int(counts.sum()) if total is None else total
        ids = self._take(k)
        res[owners] -= counts
        self._reserved -= k
        return ids, self._gen[ids]

    def acquire(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Lease ``count`` available pages directly (no owner's reservation); returns (IDs, generations).

        Used for replicas that belong to no active address space (a checkpoint's pages restored
        from the Host tier).  Raises :class:`PoolCapacityError` (nothing changed) when fewer than
        ``count`` pages are available.
        """
        count = int(count)
        if count < 0:
            raise ValueError(f"pool {self.name}: acquire count={count} must be >= 0")
        if count > self.available:
            raise PoolCapacityError(
                f"pool {self.name}: cannot lease {count} pages; only {self.available} of {self.capacity} are "
                f"available ({self.allocated} allocated, {self.reserved} reserved)"
            )
        if count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ids = self._take(count)
        return ids, self._gen[ids]

    def undo_acquire(self, pages: np.ndarray) -> None:
        """Exact inverse of an :meth:`acquire` whose leases never escaped (no generation bump)."""
        ids = _as_ids(pages)
        if ids.size:
            self._give_back(ids, bump=False)

    def dematerialize(self, pages, generations, owner: int) -> None:
        """Return leases to ``owner``'s reservation (the global available count is unchanged)."""
        o = self._owner(owner)
        ids = _as_ids(pages)
        self.check_leases(ids, generations)
        if ids.size == 0:
            return
        self._give_back(ids, bump=True)
        self._res[o] += ids.size
        self._reserved += ids.size

    def dematerialize_many(self, pages: np.ndarray, generations: np.ndarray, owners: np.ndarray) -> None:
        """Vectorized :meth:`dematerialize`: ``pages[i]`` returns to ``owners[i]``'s reservation."""
        self.check_leases(pages, generations)
        if pages.size == 0:
            return
        self._give_back(pages, bump=True)
        np.add.at(self._res, owners, 1)
        self._reserved += pages.size

    def release(self, pages, generations) -> None:
        """Return leases to the global available count."""
        ids = _as_ids(pages)
        self.check_leases(ids, generations)
        if ids.size == 0:
            return
        self._give_back(ids, bump=True)

    def undo_materialize(self, owner: int, pages: np.ndarray) -> None:
        """Exact inverse of a :meth:`materialize` whose leases never escaped (no generation bump)."""
        ids = _as_ids(pages)
        if ids.size == 0:
            return
        self._give_back(ids, bump=False)
        self._res[self._owner(owner)] += ids.size
        self._reserved += ids.size

    # -- checks ---------------------------------------------------------------------------------------
    def audit_invariants(self) -> None:
        """Raise :class:`InvariantError` unless the counts and the free set agree."""
        free_count = int(self._free.sum())
        if free_count != self._free_count:
            raise InvariantError(f"pool {self.name}: free bitmap holds {free_count} IDs, counter says {self._free_count}")
        if int(self._res.sum()) != self._reserved or (self._res < 0).any():
            raise InvariantError(f"pool {self.name}: reservations {self._res.tolist()} disagree with {self._reserved}")
        if self.available < 0:
            raise InvariantError(f"pool {self.name}: available={self.available} < 0")
        if self.allocated + self.reserved + self.available != self.capacity:
            raise InvariantError(f"pool {self.name}: allocated + reserved + available != capacity")
        if self._free_count and self._hint > int(np.flatnonzero(self._free)[0]):
            raise InvariantError(f"pool {self.name}: search hint {self._hint} skips a free page")

    def snapshot(self) -> dict:
        """A comparable copy of the pool's semantic state (the search hint is a cache, excluded)."""
        return {
            "free": self._free.copy(),
            "generation": self._gen.copy(),
            "reservations": self._res.copy(),
            "reserved": self._reserved,
            "free_count": self._free_count,
        }

    def __repr__(self) -> str:
        return (
            f"DevicePagePool({self.name!r}, capacity={self.capacity}, allocated={self.allocated}, "
            f"reserved={self.reserved}, available={self.available})"
        )
