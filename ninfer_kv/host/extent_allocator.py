"""A bounded, variable-size extent allocator over one fixed byte range.

Policy: **best fit** over a free list kept sorted twice (by ``(size, offset)`` for the search, by
offset for coalescing).  An allocation of ``nbytes`` reserves a *span* of
``round_up(nbytes, alignment)`` bytes from the start of the smallest free extent that holds it
(ties go to the lowest offset); the remainder stays free.  Freeing an extent merges it with free
neighbours on both sides at once, so the free list never holds two adjacent extents and has at
most ``live extents + 1`` entries.  Search is a bisection; insertion and removal are list
``memmove`` operations, ``O(free extents)`` with a tiny constant.

Accounting is byte-exact: ``used_bytes`` is the sum of the exact requested sizes of live extents
(the packed payload), ``padding_bytes`` the alignment slack of their spans, and at every instant
``used_bytes + padding_bytes + free_bytes == capacity``.

Worst-case fragmentation.  Extents never move (no compaction: a Host extent is referenced by
logical pages and may be the source or destination of an in-flight copy), and no non-moving
allocator can bound external fragmentation by free bytes alone.  Robson showed that *any* such
allocator can be driven to need about ``(M / 2) * log2(n)`` bytes to serve a live peak of ``M``
bytes with request sizes between 1 and ``n`` units, and best fit's own worst case grows roughly as
``M * n``.  A simple instance: alternating live and free one-unit extents leave half the range free
while the largest free extent is one unit.  Hence free bytes never prove anything here:
:meth:`ExtentAllocator.allocate` fails only when no single free extent holds the span, and a
multi-step release/allocation recipe is proven by :meth:`ExtentAllocator.validate_plan`, which
replays it on a copy of the free list with the same policy the real execution uses.

Handles are generation-checked: a :class:`HostExtent` names a slot and the slot's generation at
allocation time; freeing advances the generation, so a stale handle (double free, use after free,
a handle of another allocator) is rejected with :class:`StaleExtentError`.

Every failing call (exhaustion, invalid plan, stale handle, bad argument) raises before any state
changes.  The allocator is not thread-safe; one thread owns it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

import numpy as np

__all__ = [
    "ExtentAllocator",
    "HostExtent",
    "ExtentOccupancy",
    "TagOccupancy",
    "ExtentPlan",
    "ExtentAllocationError",
    "InvalidPlanError",
    "StaleExtentError",
]

_ALLOCATOR_IDS = itertools.count(1)


class StaleExtentError(ValueError):
    """An extent handle does not name a live extent of this allocator (freed, reused or foreign)."""


class ExtentAllocationError(MemoryError):
    """No free extent can hold a requested span.

    Attributes: ``requested_bytes`` (exact payload), ``span_bytes`` (aligned), ``largest_free_extent``
    and ``free_bytes`` (both at the moment of the failing request).
    """

    def __init__(
        self, message: str, *, requested_bytes: int, span_bytes: int, largest_free_extent: int, free_bytes: int
    ):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.span_bytes = span_bytes
        self.largest_free_extent = largest_free_extent
        self.free_bytes = free_bytes


class InvalidPlanError(ExtentAllocationError):
    """A release/allocation recipe does not fit the current extent geometry.

    ``step`` is the index of the first allocation step that cannot be placed.
    """

    def __init__(self, message: str, *, step: int, **kw):
        super().__init__(message, **kw)
        self.step = step


@dataclasses.dataclass(frozen=True)
class HostExtent:
    """Handle of one live extent: ``nbytes`` packed payload bytes at ``offset`` in a ``span`` of
    ``round_up(nbytes, alignment)`` bytes, tagged with the pool that owns it.

    The handle is a value; validity is checked by the allocator against ``(slot, generation)``.
    """

    allocator_id: int
    slot: int
    generation: int
    offset: int
    nbytes: int
    span: int
    tag: str

    @property
    def padding(self) -> int:
        """Alignment slack of the span in bytes, ``span - nbytes``."""
        return self.span - self.nbytes

    @property
    def end(self) -> int:
        """One past the last byte of the span."""
        return self.offset + self.span


@dataclasses.dataclass(frozen=True)
class TagOccupancy:
    """Live extents of one tag (pool): packed bytes, alignment padding and extent count."""

    used_bytes: int
    padding_bytes: int
    extent_count: int

    def to_json(self) -> dict:
        """``{"used_bytes", "padding_bytes", "extent_count"}``."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ExtentOccupancy:
    """Occupancy summary.  ``used_bytes + padding_bytes + free_bytes == capacity``.

    ``fragmentation`` is ``1 - largest_free_extent / free_bytes`` (0 when nothing is free): 0 means
    all free bytes form one extent, values near 1 mean free bytes are scattered in small pieces.
    """

    capacity: int
    alignment: int
    used_bytes: int
    padding_bytes: int
    free_bytes: int
    largest_free_extent: int
    extent_count: int
    free_extent_count: int
    fragmentation: float
    tags: dict

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict, ``tags`` as ``{tag: TagOccupancy.to_json()}``."""
        out = dataclasses.asdict(self)
        out["tags"] = {k: v.to_json() for k, v in self.tags.items()}
        return out


@dataclasses.dataclass(frozen=True)
class ExtentPlan:
    """Result of a validated recipe.

    ``offsets[i]`` is the offset the i-th *allocation* step receives when the recipe is executed
    against the state it was validated on (``version``); ``free_bytes_after`` and
    ``largest_free_after`` describe the state after the whole recipe.
    """

    version: int
    offsets: tuple[int, ...]
    spans: tuple[int, ...]
    released_bytes: int
    allocated_bytes: int
    free_bytes_after: int
    largest_free_after: int


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class _FreeList:
    """Free extents, sorted by offset and by ``(size, offset)``; never two adjacent entries."""

    __slots__ = ("offsets", "sizes", "by_size")

    def __init__(self):
        self.offsets: list[int] = []
        self.sizes: dict[int, int] = {}
        self.by_size: list[tuple[int, int]] = []

    def copy(self) -> "_FreeList":
        other = _FreeList()
        other.offsets = list(self.offsets)
        other.sizes = dict(self.sizes)
        other.by_size = list(self.by_size)
        return other

    def largest(self) -> int:
        return self.by_size[-1][0] if self.by_size else 0

    def _insert(self, offset: int, size: int) -> None:
        bisect.insort(self.offsets, offset)
        self.sizes[offset] = size
        bisect.insort(self.by_size, (size, offset))

    def _remove(self, offset: int) -> int:
        size = self.sizes.pop(offset)
        del self.offsets[bisect.bisect_left(self.offsets, offset)]
        del self.by_size[bisect.bisect_left(self.by_size, (size, offset))]
        return size

    def take(self, span: int) -> int | None:
        """Best fit: carve ``span`` bytes from the smallest free extent that holds them."""
        i = bisect.bisect_left(self.by_size, (span, -1))
        if i == len(self.by_size):
            return None
        size, offset = self.by_size[i]
        self._remove(offset)
        if size > span:
            self._insert(offset + span, size - span)
        return offset

    def give(self, offset: int, span: int) -> None:
        """Return ``[offset, offset + span)`` and merge it with free neighbours on both sides."""
        i = bisect.bisect_left(self.offsets, offset)
        if i > 0:
            prev = self.offsets[i - 1]
            if prev + self.sizes[prev] == offset:
                span += offset - prev
                self._remove(prev)
                offset = prev
        nxt = offset + span
        if nxt in self.sizes:
            span += self._remove(nxt)
        self._insert(offset, span)

    def items(self) -> list[tuple[int, int]]:
        return [(o, self.sizes[o]) for o in self.offsets]


@dataclasses.dataclass
class _Slot:
    generation: int
    live: bool = False
    offset: int = 0
    nbytes: int = 0
    span: int = 0
    tag: str = ""


class ExtentAllocator:
    """Best-fit extent allocator with coalescing over ``[0, capacity)``.

    Args:
      capacity: bytes managed; a positive multiple of ``alignment``.
      alignment: power of two; every extent starts at a multiple of it and its span is its size
        rounded up to it.
    """

    def __init__(self, capacity: int, alignment: int = 256):
        if not _is_int(alignment) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment!r} is invalid; it must be a power of two >= 1")
        if not _is_int(capacity) or capacity < alignment or capacity % alignment:
            raise ValueError(
                f"capacity={capacity!r} is invalid; it must be a positive multiple of alignment={alignment}"
            )
        self.capacity = int(capacity)
        self.alignment = int(alignment)
        self.allocator_id = next(_ALLOCATOR_IDS)
        self._free = _FreeList()
        self._free.give(0, self.capacity)
        self._slots: list[_Slot] = []
        self._spare_slots: list[int] = []
        self._live = 0
        self._used = 0
        self._padding = 0
        self._tags: dict[str, list[int]] = {}  # tag -> [used, padding, count]
        self._version = 0

    # -- queries ----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Mutation counter: advances on every successful allocate/free."""
        return self._version

    @property
    def used_bytes(self) -> int:
        """Packed payload bytes of the live extents (the exact requested sizes)."""
        return self._used

    @property
    def padding_bytes(self) -> int:
        """Alignment slack of the live extents' spans in bytes."""
        return self._padding

    @property
    def free_bytes(self) -> int:
        """Bytes in free extents, ``capacity - used_bytes - padding_bytes``."""
        return self.capacity - self._used - self._padding

    @property
    def largest_free_extent(self) -> int:
        """Bytes of the largest free extent: the largest span an allocation can get now."""
        return self._free.largest()

    @property
    def extent_count(self) -> int:
        """Live extents."""
        return self._live

    def span_of(self, nbytes: int) -> int:
        """Aligned span that an extent of ``nbytes`` payload bytes occupies."""
        return -(-nbytes // self.alignment) * self.alignment

    def occupancy(self) -> ExtentOccupancy:
        """An :class:`ExtentOccupancy` snapshot: byte counts, extent counts, fragmentation, per tag."""
        free = self.free_bytes
        largest = self._free.largest()
        return ExtentOccupancy(
            capacity=self.capacity,
            alignment=self.alignment,
            used_bytes=self._used,
            padding_bytes=self._padding,
            free_bytes=free,
            largest_free_extent=largest,
            extent_count=self._live,
            free_extent_count=len(self._free.offsets),
            fragmentation=0.0 if free == 0 else 1.0 - largest / free,
            tags={t: TagOccupancy(*v) for t, v in sorted(self._tags.items())},
        )

    def free_extents(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free extent, by offset."""
        return self._free.items()

    def live_extents(self) -> list[HostExtent]:
        """Handles of every live extent, by offset."""
        out = [self._handle(i) for i, s in enumerate(self._slots) if s.live]
        return sorted(out, key=lambda e: e.offset)

    def check(self, extent: HostExtent, what: str = "extent") -> None:
        """Raise :class:`StaleExtentError` unless ``extent`` names a live extent of this allocator."""
        if not isinstance(extent, HostExtent):
            raise TypeError(f"{what} must be a HostExtent, got {type(extent).__name__}")
        if extent.allocator_id != self.allocator_id:
            raise StaleExtentError(
                f"{what} {self._describe(extent)} belongs to another arena (allocator {extent.allocator_id}, "
                f"this is {self.allocator_id})"
            )
        slot = self._slots[extent.slot] if 0 <= extent.slot < len(self._slots) else None
        if slot is None or slot.generation != extent.generation or not slot.live:
            now = "never allocated" if slot is None else (
                f"slot is at generation {slot.generation}, {'live' if slot.live else 'free'}"
            )
            raise StaleExtentError(f"{what} {self._describe(extent)} is stale ({now}); it was freed or never issued")
        if (slot.offset, slot.nbytes, slot.span, slot.tag) != (extent.offset, extent.nbytes, extent.span, extent.tag):
            raise StaleExtentError(f"{what} {self._describe(extent)} does not match the live extent of its slot")

    def is_live(self, extent: HostExtent) -> bool:
        """Whether ``extent`` is a live extent of this allocator (:meth:`check` without raising)."""
        try:
            self.check(extent)
        except (StaleExtentError, TypeError):
            return False
        return True

    # -- mutation ---------------------------------------------------------------------------------
    def allocate(self, nbytes: int, tag: str = "main") -> HostExtent:
        """Allocate an extent of exactly ``nbytes`` payload bytes (span rounded up to the alignment).

        Raises :class:`ExtentAllocationError` (state unchanged) naming the requested bytes, the
        largest free extent and the free bytes when no free extent holds the span.
        """
        nbytes = self._check_nbytes(nbytes, "nbytes")
        tag = self._check_tag(tag)
        span = self.span_of(nbytes)
        offset = self._free.take(span)
        if offset is None:
            raise self._exhausted(nbytes, span, self._free, self.free_bytes)
        return self._commit_allocation(offset, nbytes, span, tag)

    def free(self, extent: HostExtent) -> None:
        """Free a live extent; its span merges with free neighbours.  Stale handles are rejected."""
        self.check(extent)
        slot = self._slots[extent.slot]
        self._free.give(slot.offset, slot.span)
        self._live -= 1
        self._used -= slot.nbytes
        self._padding -= slot.span - slot.nbytes
        t = self._tags[slot.tag]
        t[0] -= slot.nbytes
        t[1] -= slot.span - slot.nbytes
        t[2] -= 1
        if t[2] == 0:
            del self._tags[slot.tag]
        slot.live = False
        slot.generation += 1
        self._spare_slots.append(extent.slot)
        self._version += 1

    def validate_plan(self, recipe) -> ExtentPlan:
        """Prove that a recipe fits the current extent geometry, without changing anything.

        ``recipe`` is an ordered sequence of steps ``("release", extent)``,
        ``("allocate", nbytes)`` or ``("allocate", nbytes, tag)``.  The steps are replayed in
        order on a copy of the free list with the same best-fit policy as :meth:`allocate`, so a
        release early in the recipe can make a later allocation fit, and an allocation fails when
        no single free extent holds it, however many bytes are free in total.

        Raises :class:`InvalidPlanError` naming the step, the requested bytes, and the largest free
        extent and free bytes at that step; :class:`StaleExtentError` for a stale or repeated
        release; ``ValueError``/``TypeError`` for a malformed step.
        """
        return self._simulate(self._parse_recipe(recipe))

    def execute_plan(self, recipe) -> list[HostExtent]:
        """Validate ``recipe`` and then apply it; returns the extents of its allocation steps.

        All-or-nothing: when validation fails nothing changes; when it succeeds every step is
        applied (execution repeats the simulation exactly, so it cannot fail).
        """
        steps = self._parse_recipe(recipe)
        plan = self._simulate(steps)
        out = []
        for kind, arg, tag in steps:
            if kind == "release":
                self.free(arg)
            else:
                out.append(self.allocate(arg, tag))
        assert tuple(e.offset for e in out) == plan.offsets, "execution diverged from its validated plan"
        return out

    # -- consistency ------------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """A hashable value of the whole state (equal snapshots == identical allocator state)."""
        return (
            self.capacity,
            self.alignment,
            self._version,
            tuple(self._free.items()),
            tuple(self._free.by_size),
            tuple((s.generation, s.live, s.offset, s.nbytes, s.span, s.tag) for s in self._slots),
            tuple(self._spare_slots),
            self._live,
            self._used,
            self._padding,
            tuple(sorted((k, tuple(v)) for k, v in self._tags.items())),
        )

    def describe(self) -> tuple:
        """A hashable value of what the arena holds: the free ranges and the live extents by offset,
        size and tag, and the byte accounting — not the handle bookkeeping (slot numbers,
        generations, the version counter), so a full rollback (allocate, then free) describes the
        same as before while :meth:`snapshot` does not."""
        live = sorted((sl.offset, sl.nbytes, sl.span, sl.tag) for sl in self._slots if sl.live)
        return (self.capacity, self.alignment, tuple(self._free.items()), tuple(live), self._used, self._padding)

    def audit_invariants(self) -> None:
        """Verify every structural invariant; raises ``AssertionError`` naming the first violation."""
        free = self._free.items()
        assert self._free.offsets == sorted(self._free.offsets), "free offsets not sorted"
        assert sorted((s, o) for o, s in free) == self._free.by_size, "size index out of sync"
        live = [(s.offset, s.span, s.nbytes, s.tag) for s in self._slots if s.live]
        spans = sorted([(o, sz, "free") for o, sz in free] + [(o, sp, "live") for o, sp, _, _ in live])
        cursor = 0
        prev_kind = None
        for offset, size, kind in spans:
            assert size > 0, f"empty {kind} extent at {offset}"
            assert offset == cursor, f"gap or overlap at byte {cursor} (next extent starts at {offset})"
            assert offset % self.alignment == 0, f"{kind} extent at {offset} is not aligned to {self.alignment}"
            assert not (kind == "free" and prev_kind == "free"), f"adjacent free extents at {offset} not coalesced"
            cursor += size
            prev_kind = kind
        assert cursor == self.capacity, f"extents cover {cursor} bytes, capacity is {self.capacity}"
        used = sum(n for _, _, n, _ in live)
        padding = sum(sp - n for _, sp, n, _ in live)
        assert (used, padding, len(live)) == (self._used, self._padding, self._live), "accounting out of sync"
        assert used + padding + sum(sz for _, sz in free) == self.capacity, "used + padding + free != capacity"
        tags: dict[str, list[int]] = {}
        for _, sp, n, tag in live:
            t = tags.setdefault(tag, [0, 0, 0])
            t[0] += n
            t[1] += sp - n
            t[2] += 1
        assert tags == self._tags, "per-tag accounting out of sync"

    # -- internals --------------------------------------------------------------------------------
    def _handle(self, slot_index: int) -> HostExtent:
        s = self._slots[slot_index]
        return HostExtent(self.allocator_id, slot_index, s.generation, s.offset, s.nbytes, s.span, s.tag)

    @staticmethod
    def _describe(extent: HostExtent) -> str:
        return (
            f"(slot {extent.slot}, generation {extent.generation}, offset {extent.offset}, "
            f"{extent.nbytes} bytes, tag {extent.tag!r})"
        )

    def _check_nbytes(self, nbytes, what: str) -> int:
        if not _is_int(nbytes) or nbytes < 1:
            raise ValueError(f"{what}={nbytes!r} is invalid; it must be an integer in [1, {self.capacity}]")
        return int(nbytes)

    @staticmethod
    def _check_tag(tag) -> str:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag={tag!r} is invalid; it must be a non-empty string naming the pool")
        return tag

    def _exhausted(self, nbytes: int, span: int, free: _FreeList, free_bytes: int, step: int | None = None):
        largest = free.largest()
        where = "" if step is None else f"recipe step {step}: "
        if span > self.capacity:
            reason = f"the arena capacity is {self.capacity} bytes"
        elif span <= free_bytes:
            reason = "enough bytes are free but no single free extent holds the span (fragmentation)"
        else:
            reason = "not enough free bytes"
        msg = (
            f"{where}host arena cannot allocate {nbytes} bytes (span {span} at alignment {self.alignment}): "
            f"largest free extent is {largest} bytes, free bytes {free_bytes} of {self.capacity}; {reason}"
        )
        kw = dict(requested_bytes=nbytes, span_bytes=span, largest_free_extent=largest, free_bytes=free_bytes)
        if step is None:
            return ExtentAllocationError(msg, **kw)
        return InvalidPlanError(msg, step=step, **kw)

    def _commit_allocation(self, offset: int, nbytes: int, span: int, tag: str) -> HostExtent:
        if self._spare_slots:
            index = self._spare_slots.pop()
        else:
            index = len(self._slots)
            self._slots.append(_Slot(generation=0))
        s = self._slots[index]
        s.live, s.offset, s.nbytes, s.span, s.tag = True, offset, nbytes, span, tag
        self._live += 1
        self._used += nbytes
        self._padding += span - nbytes
        t = self._tags.setdefault(tag, [0, 0, 0])
        t[0] += nbytes
        t[1] += span - nbytes
        t[2] += 1
        self._version += 1
        return self._handle(index)

    def _parse_recipe(self, recipe) -> list[tuple[str, object, str | None]]:
        try:
            steps_in = list(recipe)
        except TypeError:
            raise TypeError(f"recipe must be a sequence of steps, got {type(recipe).__name__}") from None
        steps = []
        for i, step in enumerate(steps_in):
            if not isinstance(step, (tuple, list)) or not step:
                raise ValueError(
                    f"recipe step {i} is {step!r}; expected ('release', extent), ('allocate', nbytes) "
                    f"or ('allocate', nbytes, tag)"
                )
            kind = step[0]
            if kind == "release" and len(step) == 2:
                self.check(step[1], what=f"recipe step {i}: release of extent")
                steps.append(("release", step[1], None))
            elif kind == "allocate" and len(step) in (2, 3):
                nbytes = self._check_nbytes(step[1], f"recipe step {i}: nbytes")
                tag = self._check_tag(step[2] if len(step) == 3 else "main")
                steps.append(("allocate", nbytes, tag))
            else:
                raise ValueError(
                    f"recipe step {i} is {step!r}; expected ('release', extent), ('allocate', nbytes) "
                    f"or ('allocate', nbytes, tag)"
                )
        return steps

    def _simulate(self, steps) -> ExtentPlan:
        free = self._free.copy()
        free_bytes = self.free_bytes
        released: set[int] = set()
        offsets, spans = [], []
        released_bytes = allocated_bytes = 0
        for i, (kind, arg, _tag) in enumerate(steps):
            if kind == "release":
                if arg.slot in released:
                    raise StaleExtentError(f"recipe step {i}: extent {self._describe(arg)} is released twice")
                released.add(arg.slot)
                free.give(arg.offset, arg.span)
                free_bytes += arg.span
                released_bytes += arg.nbytes
            else:
                span = self.span_of(arg)
                offset = free.take(span)
                if offset is None:
                    raise self._exhausted(arg, span, free, free_bytes, step=i)
                free_bytes -= span
                offsets.append(offset)
                spans.append(span)
                allocated_bytes += arg
        return ExtentPlan(
            version=self._version,
            offsets=tuple(offsets),
            spans=tuple(spans),
            released_bytes=released_bytes,
            allocated_bytes=allocated_bytes,
            free_bytes_after=free_bytes,
            largest_free_after=free.largest(),
        )
