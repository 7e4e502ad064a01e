"""KVAddressSpace: one continuation's ordered view of one pool's logical pages.

Each address space holds

* an ordered membership: logical block ``b`` (tokens ``[b*P, (b+1)*P)``) -> logical page;
* the committed frontier (tokens the consumer may read) and the checkpoint-protected frontier (the
  prefix whose pages are shared with checkpoints and therefore immutable for this space);
* active/inactive state, the entitlement (pages the space is guaranteed to obtain) and, while
  active, an execution row.

Storage is a struct of numpy arrays indexed by a *space slot*.  Slots ``[0, C)`` are the execution
rows: an active address space lives in the slot of the row it leases, so the decode round indexes
its frontiers by row with no indirection.  Inactive spaces (retained checkpoints) live in slots
``>= C`` and hold no row; activating one moves its state into a row slot.

Invariants (checked by ``KVStore.audit_invariants``):

* ``membership[s, :n_blocks[s]]`` are live pages; entries beyond are ``-1``;
* ``mapped[s] == n_blocks[s] * P >= committed[s] >= protected[s]``;
* an active space's reservation equals ``entitlement_pages - n_blocks`` (mapping within the
  entitlement can therefore never fail);
* an inactive space is immutable, holds exactly ``ceil(committed / P)`` pages and no reservation.
"""

from __future__ import annotations

import numpy as np

from ..schema.geometry import PAGE_SIZE
from ..schema.errors import InvariantError, StaleHandleError
from .columns import Column, ColumnTable
from .logical_page import GenerationCheckedView, LogicalKVPage

__all__ = ["AddressSpaceTable", "KVAddressSpace"]

_SHIFT = PAGE_SIZE.bit_length() - 1


class AddressSpaceTable(ColumnTable):
    """Struct-of-arrays address spaces of one pool: ``rows`` row slots, then inactive slots."""

    I64 = np.int64
    COLUMNS = {
        "generation": Column(I64, 0),
        "live": Column(bool, False),
        "active": Column(bool, False),
        "membership": Column(I64, -1, ("logical_pages",)),
        "n_blocks": Column(I64, 0),
        "mapped": Column(I64, 0),
        "committed": Column(I64, 0),
        "protected": Column(I64, 0),
        "ent_pages": Column(I64, 0),
        "target": Column(I64, 0),
        "growth": Column(bool, False),
        "bundle": Column(I64, -1),
    }
    _CONTENT = tuple(n for n in COLUMNS if n != "generation")  # what a cleared slot forgets

    def __init__(self, rows: int, logical_pages: int, *, pool: str, inactive: int = 8):
        self.pool = pool
        self.rows = int(rows)
        self.logical_pages = int(logical_pages)
        self.init_columns()
        self._free_inactive: list[int] = []
        self.grow(self.rows + max(int(inactive), 1))

    def grow(self, capacity: int) -> None:
        """Enlarge the table to ``capacity`` slots (new inactive slots are free)."""
        old = self.capacity
        if not self.grow_columns(capacity):
            return
        fresh = [s for s in range(capacity - 1, old - 1, -1) if s >= self.rows]
        self._free_inactive = fresh + self._free_inactive  # pop() keeps returning the lowest first

    # -- slots ------------------------------------------------------------------------------------------
    def alloc_inactive(self) -> int:
        if not self._free_inactive:
            self.grow(2 * self.capacity)
        return self._free_inactive.pop()

    def clear(self, slot: int, *, bump: bool) -> None:
        """Reset ``slot`` to the empty state; ``bump`` advances its generation (a real end)."""
        self.reset_columns(slot, self._CONTENT)
        if bump:
            self.generation[slot] += 1
        if slot >= self.rows:
            self._free_inactive.append(slot)

    # -- transitions --------------------------------------------------------------------------------------
    def append_blocks(
        self, rows: np.ndarray, owner: np.ndarray, blocks: np.ndarray, slots: np.ndarray, need: np.ndarray
    ) -> None:
        """Map pages ``slots`` at ``(owner, blocks)``; ``rows`` then hold ``need`` blocks (mapped == blocks * P)."""
        self.membership[owner, blocks] = slots
        self.n_blocks[rows] = need
        self.mapped[rows] = need << _SHIFT

    def drop_blocks(self, rows: np.ndarray, owner: np.ndarray, blocks: np.ndarray, keep: np.ndarray) -> None:
        """Unmap ``(owner, blocks)``; rows ``rows`` then hold ``keep`` blocks (entries beyond are -1)."""
        self.membership[owner, blocks] = -1
        self.n_blocks[rows] = keep
        self.mapped[rows] = keep << _SHIFT

    def set_committed(self, rows, frontiers) -> None:
        """Set committed frontiers (callers keep ``protected <= committed <= mapped``)."""
        self.committed[rows] = frontiers

    def claim(self, row: int, bundle: int, ent_pages: int, target: int, growth: bool) -> None:
        """Make the free row slot ``row`` live (empty membership) with its entitlement; undone by ``clear``."""
        if self.live[row]:
            raise InvariantError(f"pool {self.pool}: row slot {row} is already in use")
        self.live[row] = True
        self.ent_pages[row] = ent_pages
        self.target[row] = target
        self.growth[row] = growth
        self.bundle[row] = bundle

    def set_prefix(self, row: int, slots: np.ndarray, committed: int) -> None:
        """Give the empty ``row`` the membership ``slots`` (mapped == len * P) and frontier ``committed``."""
        blocks = slots.size
        self.membership[row, :blocks] = slots
        self.n_blocks[row] = blocks
        self.mapped[row] = blocks * PAGE_SIZE
        self.committed[row] = committed

    def clear_prefix(self, row: int, blocks: int) -> None:
        """Exact inverse of :meth:`set_prefix` with ``blocks`` pages: ``row`` is empty again."""
        self.membership[row, :blocks] = -1
        self.n_blocks[row] = 0
        self.mapped[row] = 0
        self.committed[row] = 0

    def push_tail(self, row: int, block: int, slot: int, committed: int) -> None:
        """Map ``slot`` as the last block ``block`` of ``row`` and set its frontier to ``committed``."""
        self.membership[row, block] = slot
        self.n_blocks[row] = block + 1
        self.mapped[row] = (block + 1) * PAGE_SIZE
        self.committed[row] = committed

    def pop_tail(self, row: int, block: int) -> None:
        """Inverse of :meth:`push_tail`: ``row`` ends at ``block`` blocks, committed up to its end."""
        self.membership[row, block] = -1
        self.n_blocks[row] = block
        self.mapped[row] = block * PAGE_SIZE
        self.committed[row] = block * PAGE_SIZE

    def activate(self, row: int, protected: int) -> None:
        """Mark ``row`` active with checkpoint-protected frontier ``protected`` (<= committed)."""
        self.protected[row] = protected
        self.active[row] = True

    def retain(self, row: int) -> int:
        """Copy ``row`` into a fresh inactive slot (protected == committed: a checkpoint is immutable)."""
        s = self.alloc_inactive()
        self.live[s] = True
        self.membership[s] = self.membership[row]
        self.n_blocks[s] = self.n_blocks[row]
        self.mapped[s] = self.mapped[row]
        self.committed[s] = self.committed[row]
        self.protected[s] = self.committed[row]
        self.bundle[s] = self.bundle[row]
        return s

    def add_entitlement(self, rows: np.ndarray, pages: np.ndarray) -> None:
        """Raise entitlements of distinct ``rows`` by ``pages`` (the caller reserved them)."""
        self.ent_pages[rows] += pages

    def check(self, slot: int, generation: int) -> int:
        if not 0 <= slot < self.capacity or not self.live[slot] or self.generation[slot] != generation:
            raise StaleHandleError(f"pool {self.pool}: address space (slot {slot}, generation {generation}) is stale")
        return slot

    def pages_of(self, slot: int) -> np.ndarray:
        return self.membership[slot, : self.n_blocks[slot]]

    def snapshot(self) -> dict:
        """Every column and the free inactive slots, for comparisons."""
        out = self.column_snapshot()
        out["free_inactive"] = list(self._free_inactive)
        return out


class KVAddressSpace(GenerationCheckedView):
    """Read-only view of one address space (checked against its generation on every access)."""

    __slots__ = ()
    _TABLE = "spaces"

    @property
    def active(self) -> bool:
        """Whether the space is active (leases an execution row) rather than a retained checkpoint."""
        return bool(self._rt.spaces.active[self._s()])

    @property
    def row(self) -> int | None:
        """The leased execution row (active spaces only)."""
        s = self._s()
        return s if self._rt.spaces.active[s] else None

    @property
    def committed_frontier(self) -> int:
        """Committed tokens: the prefix a consumer may read."""
        return self._int("committed")

    @property
    def protected_frontier(self) -> int:
        """Tokens shared with checkpoints: immutable for this space (0 for a root sequence)."""
        return self._int("protected")

    @property
    def num_blocks(self) -> int:
        """Logical blocks mapped to pages (``mapped_tokens / P``)."""
        return self._int("n_blocks")

    @property
    def mapped_tokens(self) -> int:
        """Tokens the membership covers: ``num_blocks * P`` (>= the committed frontier)."""
        return self._int("mapped")

    @property
    def entitlement_pages(self) -> int:
        """Pages the space is guaranteed to obtain (mapped + reserved)."""
        return self._int("ent_pages")

    @property
    def entitlement_tokens(self) -> int:
        """The entitlement in tokens (``entitlement_pages * P``)."""
        return self.entitlement_pages * self._rt.page_size

    @property
    def reserved_pages(self) -> int:
        """Reserved, not yet materialized pages (0 for inactive spaces)."""
        s = self._s()
        return self._rt.pool.reservation(s) if s < self._rt.spaces.rows else 0

    @property
    def page_slots(self) -> np.ndarray:
        """Logical page slots of the membership, in logical order (``int64 (num_blocks,)``, a copy)."""
        s = self._s()
        return self._rt.spaces.pages_of(s).copy()

    @property
    def physical_pages(self) -> np.ndarray:
        """Device page IDs of the membership, in logical order."""
        return self._rt.pages.device_page[self.page_slots].astype(np.int32)

    def pages(self) -> list[LogicalKVPage]:
        """The membership as :class:`LogicalKVPage` views, in logical order."""
        slots = self.page_slots
        gens = self._rt.pages.generation[slots]
        return [LogicalKVPage(self._rt, int(s), int(g)) for s, g in zip(slots, gens)]

    def _describe(self) -> str:
        return (
            f"pool={self.pool.value}, slot={self.slot}, active={self.active}, committed={self.committed_frontier}, "
            f"blocks={self.num_blocks}, entitlement_pages={self.entitlement_pages}"
        )
