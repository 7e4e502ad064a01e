"""PoolHostReplicas: one pool's Host replica table — which Host extent pages hold its pages' replicas.

The replica fields live in the pool's :class:`~ninfer_kv.store.logical_page.LogicalPageTable`
(``host_extent``, ``host_page``, ``host_epoch``, ``host_coverage``); this table keeps the arena
bookkeeping beside them: per live extent, how many pages still hold a replica in it.  An extent is
freed with its last page.  Its transitions (:meth:`PoolHostReplicas.hold`,
:meth:`PoolHostReplicas.release`) are called only by the pool's
:class:`~ninfer_kv.store.runtime.PoolRuntime`, together with the page table's own, so the two never
disagree.
"""

from __future__ import annotations

import numpy as np

from ..schema.errors import InvariantError
from ..host import HostExtent, HostKVArena, StaleExtentError, host_layout_of
from ..schema.layout import PagedKVStorageLayout
from .logical_page import LogicalPageTable
from .summary import HostPoolOccupancy

__all__ = ["PoolHostReplicas"]


class PoolHostReplicas:
    """Host extent memberships of one pool's logical pages.

    A page's Host replica is page ``host_page[s]`` of extent ``host_extent[s]``; one offload packs
    its pages into one extent, in the checkpoint's logical order, so several pages share an extent.

    Invariants (:meth:`audit_invariants`):

    * ``users[e]`` equals the number of live pages whose ``host_extent`` is ``e``; an extent with no
      such page is not a key (it was freed in the arena with its last page);
    * every key is a live extent of the arena tagged with this pool's name;
    * no two pages share ``(extent, page)``, and every page index lies inside its extent;
    * a page without a Host replica names no extent.
    """

    def __init__(self, pages: LogicalPageTable, layout: PagedKVStorageLayout, tag: str, arena: HostKVArena):
        self.pages = pages
        self.arena = arena
        self.layout = host_layout_of(layout)
        self.tag = tag
        self.users: dict[HostExtent, int] = {}

    # -- transitions (the pool runtime's, beside the page table's) -------------------------------------
    def hold(self, extent: HostExtent, count: int) -> None:
        """``count`` more pages hold their Host replica in ``extent``."""
        self.users[extent] = self.users.get(extent, 0) + int(count)

    def release(self, extents: list[HostExtent]) -> None:
        """One page less in each of ``extents`` (one entry per page); an extent whose last page goes
        is freed in the arena (infallible)."""
        users = self.users
        for extent in extents:
            left = users[extent] - 1
            if left:
                users[extent] = left
            else:
                del users[extent]
                self.arena.free(extent)

    # -- queries ----------------------------------------------------------------------------------------
    def restore_sources(self, slots: np.ndarray, dst_ids: np.ndarray
                        ) -> list[tuple[np.ndarray, dict, np.ndarray | None]]:
        """The Host replica of each page ``slots[i]`` as a whole-page write onto Device page
        ``dst_ids[i]``: ``[(dst ids, planes, index or None)]``, one entry per extent, in order — the
        arguments of :meth:`~ninfer_kv.store.page_writes.PageWrites.restore` (``index`` ``None``:
        the planes are the pages themselves, a contiguous run of the extent)."""
        pg = self.pages
        slots = np.asarray(slots, np.int64)
        dst_ids = np.asarray(dst_ids, np.int64)
        extents = [pg.host_extent[x] for x in slots.tolist()]  # handles (an object column: a list)
        pages = pg.host_page[slots].astype(np.int64)
        sources = []
        for extent in dict.fromkeys(extents):  # one vectorized copy per extent, in order
            at = np.array([i for i, e in enumerate(extents) if e is extent], np.int64)
            views = self.layout.page_planes(self.arena.view(extent))
            index = pages[at]
            contiguous = bool(index.size) and np.array_equal(index, np.arange(index[0], index[0] + index.size))
            if contiguous:
                sources.append((dst_ids[at], {n: v[index[0] : index[0] + index.size] for n, v in views.items()}, None))
            else:
                sources.append((dst_ids[at], views, index))
        return sources

    def occupancy(self) -> HostPoolOccupancy:
        pg = self.pages
        live = pg.live
        extent_pages = sum(self.layout.pages_in(e.nbytes) for e in self.users)
        return HostPoolOccupancy(
            pool=self.tag,
            stride=self.layout.stride,
            host_pages=int((live & (pg.host_page >= 0)).sum()),
            host_only_pages=int((live & (pg.device_page < 0)).sum()),
            extents=len(self.users),
            extent_pages=extent_pages,
            used_bytes=sum(e.nbytes for e in self.users),
        )

    def audit_invariants(self) -> None:
        pg = self.pages
        name = self.tag
        hosted = np.flatnonzero(pg.host_page >= 0)
        counts: dict[HostExtent, int] = {}
        seen: set = set()
        for s in hosted.tolist():
            extent = pg.host_extent[s]
            if extent is None or extent not in self.users:
                raise InvariantError(f"pool {name}: page slot {s} names an extent the pool does not hold")
            if extent.tag != self.tag:
                raise InvariantError(f"pool {name}: page slot {s} uses an extent tagged {extent.tag!r}")
            index = int(pg.host_page[s])
            if not 0 <= index < self.layout.pages_in(extent.nbytes):
                raise InvariantError(f"pool {name}: page slot {s} has Host page {index} outside its extent")
            if (extent, index) in seen:
                raise InvariantError(f"pool {name}: two pages share Host page {index} of one extent")
            seen.add((extent, index))
            counts[extent] = counts.get(extent, 0) + 1
        if counts != self.users:
            raise InvariantError(f"pool {name}: extent user counts disagree with the pages' Host replicas")
        if len(pg.host_extent) - pg.host_extent.count(None) != hosted.size:  # the hosted ones are not None
            raise InvariantError(f"pool {name}: a page without a Host replica names an extent")
        for extent in self.users:
            try:
                self.arena.check(extent)
            except StaleExtentError as exc:
                raise InvariantError(f"pool {name}: {exc}") from None

    def snapshot(self) -> list:
        return sorted(((e.offset, e.nbytes, e.tag), n) for e, n in self.users.items())
