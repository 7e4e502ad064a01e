"""Logical KV pages: generation-checked descriptors stored as a struct of arrays.

A logical page is the identity of one page of KV content, independent of where its bytes live.
Its descriptor holds

* ``generation`` — advances when the descriptor is reclaimed, so views and handles to an old page
  are detected as stale;
* ``epoch`` — the content epoch: advances whenever committed columns are withdrawn (a truncation
  inside the page), so bytes written later under the same column count are a different content;
* committed columns ``[0, P]`` and protected columns (the coverage surviving checkpoints need);
* address-space references, active references and the single writer (an execution row);
* an optional Device page lease (page ID + lease generation);
* an optional Host extent membership: the extent, the page's index in it and the replica's
  ``(epoch, coverage)`` as of its publication (see :class:`HostReplica`);
* transaction pins (held while a copy reads or writes the page);
* the page write that last filled its Device page from elsewhere (a partial-tail COW from another
  page, or a Host restore): the work serial that carries it, an ordering sequence number and, for a
  COW, the source page and columns — what a repair (:func:`~ninfer_kv.resync`) replays when a
  device state missed that work.

Canonical content is ``(epoch, committed columns)``.  A replica holding ``(epoch, coverage)`` is
valid for the first ``n`` columns iff ``replica.epoch == page.epoch and replica.coverage >= n``.

A descriptor is reclaimed (its generation advanced, its slot reused) only when references,
replicas (Device lease, Host extent) and pins are all zero.  A page may live with a Device replica
only, a Host replica only, or both (its *placement*); the descriptor itself holds no payload.

Storage is a struct of numpy arrays indexed by a slot, so vectorized code (the decode round) updates
many pages with a handful of array operations; :class:`LogicalKVPage` is a thin read-only view.

While a page has a writer, its committed columns are derived from the writer's committed frontier
(``clip(frontier - block * P, 0, P)``) instead of being stored; the stored column count is written
when the writer lets go.  This keeps per-token commits off the page descriptors.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from ..schema.errors import InvariantError, StaleHandleError
from .columns import Column, ColumnTable
from .pool import DeviceKVPageLease


__all__ = ["ReplicaRef", "HostReplica", "replica_valid", "LogicalPageTable", "GenerationCheckedView", "LogicalKVPage"]


@dataclasses.dataclass(frozen=True)
class ReplicaRef:
    """What a replica (Device or Host copy of a page) holds: a content epoch and a column coverage."""

    epoch: int
    coverage: int


@dataclasses.dataclass(frozen=True)
class HostReplica:
    """A page's Host extent membership: page ``page`` of ``extent`` holds ``(epoch, coverage)``.

    ``extent`` is the :class:`~ninfer_kv.host.HostExtent` handle (several pages share one extent,
    each at its own ``page`` index in logical order); ``epoch`` and ``coverage`` are the page's
    content epoch and committed columns verified when the replica was published.
    """

    extent: object
    page: int
    epoch: int
    coverage: int


def replica_valid(page_epoch: int, replica: ReplicaRef, columns: int) -> bool:
    """True iff ``replica`` is valid for the first ``columns`` columns of a page at ``page_epoch``."""
    return replica.epoch == page_epoch and replica.coverage >= columns


class LogicalPageTable(ColumnTable):
    """Descriptors of one pool's logical pages, indexed by slot (struct of arrays).

    Free slots live on a stack; allocation pops the lowest slots first and :meth:`discard` (the exact
    inverse of :meth:`create`, used by rollbacks) pushes them back in the same order, without
    advancing generations.  :meth:`reclaim` is the real end of a descriptor: it advances the
    generation.
    """

    I64 = np.int64
    COLUMNS = {
        "generation": Column(I64, 0),
        "live": Column(bool, False),
        "epoch": Column(I64, 0),
        "committed": Column(I64, 0),  # stored columns; authoritative when writer < 0
        "protected": Column(I64, 0),
        "refs": Column(I64, 0),
        "active_refs": Column(I64, 0),
        "writer": Column(I64, -1),  # execution row of the writing address space, -1: none
        "writer_block": Column(I64, 0),
        "device_page": Column(I64, -1),  # -1: no Device replica
        "device_gen": Column(I64, 0),
        "pins": Column(I64, 0),
        "host_extent": Column(object, None),  # HostExtent handle or None
        "host_page": Column(I64, -1),  # page index in host_extent, -1: no Host replica
        "host_epoch": Column(I64, 0),  # replica epoch / coverage as published
        "host_coverage": Column(I64, 0),
        "fill_work": Column(I64, -1),  # work serial of the last page write into the Device page, -1: none
        "fill_seq": Column(I64, 0),  # order of page writes within the pool
        "fill_src": Column(I64, -1),  # COW source slot, -1: a Host restore
        "fill_src_gen": Column(I64, 0),
        "fill_cols": Column(I64, 0),
    }
    _CONTENT = tuple(n for n in COLUMNS if n != "generation")  # what a cleared descriptor forgets
    _FILL = ("fill_work", "fill_seq", "fill_src", "fill_src_gen", "fill_cols")

    def __init__(self, capacity: int, *, pool: str):
        self.pool = pool
        self.init_columns()
        self._stack = np.zeros(0, np.int64)
        self._top = 0
        self.grow(max(int(capacity), 1))

    # -- slots ------------------------------------------------------------------------------------------
    def grow(self, capacity: int) -> None:
        """Enlarge the table to ``capacity`` slots (new slots are free)."""
        old = self.capacity
        n = self.grow_columns(capacity)
        if not n:
            return
        # new slots go to the bottom of the stack so existing free slots keep their order
        stack = np.empty(capacity, np.int64)
        stack[:n] = np.arange(capacity - 1, old - 1, -1)
        stack[n : n + self._top] = self._stack[: self._top]
        self._stack = stack
        self._top += n

    @property
    def num_live(self) -> int:
        return self.capacity - self._top

    def pop_slots(self, k: int) -> np.ndarray:
        """Take ``k`` free slots (lowest first); the caller initializes them as live pages."""
        if k > self._top:
            self.grow(max(2 * self.capacity, self.capacity + k))
        top = self._top
        self._top = top - k
        return self._stack[top - k : top][::-1].copy()

    def create(self, device_page: np.ndarray, device_gen: np.ndarray, writer, writer_block) -> np.ndarray:
        """Create ``len(device_page)`` private pages (one reference, active, with a writer)."""
        slots = self.pop_slots(int(device_page.size))
        self.live[slots] = True
        self.refs[slots] = 1
        self.active_refs[slots] = 1
        self.writer[slots] = writer
        self.writer_block[slots] = writer_block
        self.device_page[slots] = device_page
        self.device_gen[slots] = device_gen
        return slots

    def _clear(self, slots: np.ndarray) -> None:
        self.reset_columns(slots, self._CONTENT)

    def _clear_fill(self, slots: np.ndarray) -> None:
        self.reset_columns(slots, self._FILL)

    def discard(self, slots: np.ndarray) -> None:
        """Exact inverse of :meth:`create` for pages that never escaped (no generation advance)."""
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            return
        self._clear(slots)
        k = slots.size
        self._stack[self._top : self._top + k] = slots[::-1]
        self._top += k

    def reclaim(self, slots: np.ndarray) -> None:
        """End descriptors whose references, replicas and pins are all zero (generation advances)."""
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            return
        if (self.refs[slots] != 0).any() or (self.pins[slots] != 0).any() or (self.device_page[slots] >= 0).any():
            raise InvariantError(f"pool {self.pool}: reclaiming a page that still has references, pins or replicas")
        if (self.host_page[slots] >= 0).any():
            raise InvariantError(f"pool {self.pool}: reclaiming a page that still has a Host extent")
        self._clear(slots)
        self.generation[slots] += 1
        k = slots.size
        self._stack[self._top : self._top + k] = slots[::-1]
        self._top += k

    # -- transitions of the Device replica and the transaction pins ---------------------------------
    def set_device(self, slots: np.ndarray, pages: np.ndarray, generations: np.ndarray) -> None:
        """Publish Device leases ``(pages, generations)`` as the Device replicas of ``slots``."""
        self.device_page[slots] = pages
        self.device_gen[slots] = generations

    def clear_device(self, slots: np.ndarray) -> None:
        """Drop the Device replicas of ``slots`` (their leases are released by the caller)."""
        self.device_page[slots] = -1
        self.device_gen[slots] = 0
        self._clear_fill(slots)

    def record_fill(self, slots: np.ndarray, work: int, seq: np.ndarray, src: np.ndarray, src_gen: np.ndarray,
                    columns: np.ndarray) -> None:
        """The Device pages of ``slots`` are filled by page writes of work ``work`` (order ``seq``):
        copies of ``columns`` columns from pages ``src`` (generation ``src_gen``), or Host restores
        where ``src == -1``."""
        self.fill_work[slots] = work
        self.fill_seq[slots] = seq
        self.fill_src[slots] = src
        self.fill_src_gen[slots] = src_gen
        self.fill_cols[slots] = columns

    def defer_fills(self, work: int) -> None:
        """Page writes recorded for work ``work`` (or later) ride work ``work + 1`` instead: a repair
        work was taken first and left them pending."""
        self.fill_work[self.fill_work >= work] = work + 1

    def pin(self, slots: np.ndarray) -> None:
        """One transaction pin more on each page (a copy in flight reads or writes it)."""
        self.pins[slots] += 1

    def drop_pin(self, slots: np.ndarray) -> None:
        """One transaction pin less on each page (the release of a dead page is the runtime's)."""
        self.pins[slots] -= 1

    # -- transitions of references, writers and content ----------------------------------------------
    def add_refs(self, slots: np.ndarray, *, active: bool) -> None:
        """One address-space reference more on each page (and one active reference if ``active``)."""
        self.refs[slots] += 1
        if active:
            self.active_refs[slots] += 1

    def unref(self, slots: np.ndarray, *, active: bool) -> None:
        """Exact inverse of :meth:`add_refs` (never releases: the pages stay referenced elsewhere)."""
        self.refs[slots] -= 1
        if active:
            self.active_refs[slots] -= 1

    def drop_refs(self, slots: np.ndarray) -> np.ndarray:
        """One reference less on each page; returns the pages left with no reference and no pin."""
        self.refs[slots] -= 1
        dead = slots[self.refs[slots] == 0]
        return dead[self.pins[dead] == 0]

    def drop_active_refs(self, slots: np.ndarray) -> None:
        """One active reference less on each page (its address space left execution)."""
        self.active_refs[slots] -= 1

    def retire_source(self, slots: np.ndarray) -> None:
        """A moved checkpoint lets go of ``slots``: pages now held only once lose their protection."""
        self.refs[slots] -= 1
        sole = slots[self.refs[slots] == 1]
        self.protected[sole] = 0

    def set_writer(self, slots: np.ndarray, row: int, blocks: np.ndarray) -> None:
        """Row ``row`` writes ``slots`` at ``blocks`` (committed columns derive from its frontier)."""
        self.writer[slots] = row
        self.writer_block[slots] = blocks

    def release_writer(self, slots: np.ndarray, committed: np.ndarray) -> None:
        """The writer lets go: store the derived ``committed`` columns, no writer left."""
        self.committed[slots] = committed
        self.writer[slots] = -1
        self.writer_block[slots] = 0

    def clear_writer(self, slots: np.ndarray) -> None:
        """Dead pages lose their writer (before they are reclaimed)."""
        self.writer[slots] = -1

    def protect_committed(self, slots: np.ndarray) -> None:
        """Protected columns cover at least the stored committed ones (a checkpoint now holds them)."""
        self.protected[slots] = np.maximum(self.protected[slots], self.committed[slots])

    def bump_epoch(self, slots: np.ndarray) -> None:
        """Committed columns of distinct ``slots`` were withdrawn: their content epoch advances."""
        self.epoch[slots] += 1

    def drop_private(self, slots: np.ndarray) -> None:
        """Reclaim trimmed private pages whose Device leases the caller dematerialized."""
        self.device_page[slots] = -1
        self.refs[slots] = 0
        self.active_refs[slots] = 0
        self.writer[slots] = -1
        self.reclaim(slots)

    # -- transitions of the Host replica ------------------------------------------------------------
    def publish_host_replicas(self, slots: np.ndarray, extent, epochs: np.ndarray, coverages: np.ndarray) -> None:
        """Page ``i`` of ``extent`` becomes the Host replica ``(epochs[i], coverages[i])`` of ``slots[i]``."""
        self.host_page[slots] = np.arange(slots.size)
        self.host_epoch[slots] = epochs
        self.host_coverage[slots] = coverages
        extents = self.host_extent
        for s in slots.tolist():
            extents[s] = extent

    def clear_host_replicas(self, slots: np.ndarray) -> list:
        """Drop the Host replicas of ``slots``; returns their former extents, in order of ``slots``."""
        extents = self.host_extent
        old = []
        for s in slots.tolist():
            old.append(extents[s])
            extents[s] = None
        self.host_page[slots] = -1
        self.host_epoch[slots] = 0
        self.host_coverage[slots] = 0
        return old

    def host_valid(self, slots: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Per page: whether its Host replica exists and is valid for the first ``columns`` columns."""
        return (self.host_page[slots] >= 0) & (self.host_epoch[slots] == self.epoch[slots]) & (
            self.host_coverage[slots] >= columns
        )

    def host_replica(self, slot: int) -> HostReplica | None:
        if self.host_page[slot] < 0:
            return None
        return HostReplica(
            self.host_extent[slot], int(self.host_page[slot]), int(self.host_epoch[slot]), int(self.host_coverage[slot])
        )

    def free_slots(self) -> np.ndarray:
        return self._stack[: self._top].copy()

    def check(self, slot: int, generation: int) -> int:
        if not 0 <= slot < self.capacity or not self.live[slot] or self.generation[slot] != generation:
            raise StaleHandleError(
                f"pool {self.pool}: logical page (slot {slot}, generation {generation}) is stale or unknown"
            )
        return slot

    def snapshot(self) -> dict:
        """Every column (Host extents by offset, size and tag) and the free slots, for comparisons."""
        out = self.column_snapshot()
        out["host_extent"] = [None if e is None else (e.offset, e.nbytes, e.tag) for e in self.host_extent]
        out["free_slots"] = self.free_slots()
        return out


class GenerationCheckedView:
    """Read-only view of one slot of a pool runtime's table, checked against the slot's generation
    on every access (a :class:`~ninfer_kv.schema.errors.StaleHandleError` once the slot was reclaimed).

    Subclasses name the runtime's table (``_TABLE``) and what their ``repr`` shows (``_describe``).
    """

    __slots__ = ("_rt", "slot", "generation")
    _TABLE = ""  # the runtime attribute holding the table: "pages" or "spaces"

    def __init__(self, runtime, slot: int, generation: int):
        self._rt = runtime
        self.slot = int(slot)
        self.generation = int(generation)

    def _s(self) -> int:
        return getattr(self._rt, self._TABLE).check(self.slot, self.generation)

    def _int(self, column: str) -> int:
        """The viewed slot's entry of the table column ``column``, as an ``int``."""
        return int(getattr(getattr(self._rt, self._TABLE), column)[self._s()])

    @property
    def pool(self):
        """The :class:`~ninfer_kv.schema.kinds.PoolKind` of the viewed pool."""
        return self._rt.kind

    def _describe(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}({self._describe()})"
        except StaleHandleError:
            return f"{type(self).__name__}(slot={self.slot}, gen={self.generation}, stale)"


class LogicalKVPage(GenerationCheckedView):
    """Read-only view of one logical page descriptor (checked against its generation on access)."""

    __slots__ = ()
    _TABLE = "pages"

    @property
    def epoch(self) -> int:
        """The content epoch (advances when committed columns are withdrawn)."""
        return self._int("epoch")

    @property
    def committed_columns(self) -> int:
        """Committed columns ``[0, P]`` (derived from the writer's frontier while it has one)."""
        s = self._s()
        return int(self._rt.page_committed(np.array([s]))[0])

    @property
    def protected_columns(self) -> int:
        """Columns surviving checkpoints need (never overwritten)."""
        return self._int("protected")

    @property
    def references(self) -> int:
        """Address spaces (active or retained) that map this page."""
        return self._int("refs")

    @property
    def active_references(self) -> int:
        """Active address spaces that map this page."""
        return self._int("active_refs")

    @property
    def writer_row(self) -> int | None:
        """The execution row of the single writing address space, or ``None``."""
        w = self._int("writer")
        return None if w < 0 else w

    @property
    def pins(self) -> int:
        """Transaction pins: copies in flight that read or write the page."""
        return self._int("pins")

    @property
    def device_lease(self) -> DeviceKVPageLease | None:
        """The Device replica's :class:`DeviceKVPageLease` (page ID + generation), or ``None`` (Host-only)."""
        s = self._s()
        p = int(self._rt.pages.device_page[s])
        if p < 0:
            return None
        return DeviceKVPageLease(self._rt.pool.name, p, int(self._rt.pages.device_gen[s]))

    @property
    def host_extent(self):
        """The :class:`~ninfer_kv.host.HostExtent` holding this page's Host replica, or ``None``."""
        return self._rt.pages.host_extent[self._s()]

    @property
    def host_replica(self) -> HostReplica | None:
        """The Host extent membership (extent, page index, epoch, coverage), or ``None``."""
        return self._rt.pages.host_replica(self._s())

    @property
    def placement(self) -> str:
        """``"device"``, ``"host"`` or ``"both"``: where the page has replicas valid for its content.

        A Host replica counts only while valid for the committed columns (a stale one is ignored).
        """
        s = self._s()
        pg = self._rt.pages
        host = bool(pg.host_valid(np.array([s]), self._rt.page_committed(np.array([s])))[0])
        device = pg.device_page[s] >= 0
        return "both" if host and device else ("host" if host else "device")

    @property
    def shared(self) -> bool:
        """Whether more than one address space maps the page (it is then immutable)."""
        return self.references > 1

    @property
    def immutable(self) -> bool:
        """A full page referenced by more than one address space, or a page with no writer."""
        return self.shared or self.writer_row is None

    @property
    def canonical(self) -> ReplicaRef:
        """The canonical content ``(epoch, committed columns)``."""
        return ReplicaRef(self.epoch, self.committed_columns)

    def replica_valid(self, replica: ReplicaRef, columns: int) -> bool:
        """Whether ``replica`` is valid for the first ``columns`` columns of this page's content."""
        return replica_valid(self.epoch, replica, columns)

    def _describe(self) -> str:
        return (
            f"pool={self.pool.value}, slot={self.slot}, gen={self.generation}, epoch={self.epoch}, "
            f"committed={self.committed_columns}, refs={self.references}, writer={self.writer_row}, "
            f"device={self.device_lease}, placement={self.placement}"
        )
