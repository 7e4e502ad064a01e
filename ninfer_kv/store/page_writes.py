"""PageWrites: one pool's pending page writes between two takes, resolved to pre-work sources.

The COW copies and Host restores a verb records go here; :meth:`PageWrites.take` turns them into
the ``copies``, ``restores`` and ``payload`` of the pool's next :class:`~ninfer_kv.work.PoolWork`
(bucketed shapes, padding entries writing nothing).  Every destination is distinct within a work
and every source reads the content the page had *before* the work: a write whose source was itself
written earlier in the same work resolves to that earlier write's source, and a later write to a
destination replaces an earlier one, so the device's one parallel gather-then-scatter equals the
sequential history.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..geometry import PAGE_SIZE
from ..layout import word_dtype
from .buckets import bucket, ladder

__all__ = ["PageWrites"]


class PageWrites:
    """Pending page writes of one pool between two takes, resolved to pre-work sources.

    ``writes[dst] = (from_payload, source, columns)``: ``source`` is a device page (content before
    the work) or an index into ``payload``.  A journal makes every change undoable
    (:meth:`mark` / :meth:`rollback`), for activation and transfer rollbacks.
    """

    def __init__(self, layout, num_pages: int):
        self.layout = layout
        self.num_pages = int(num_pages)
        self.names = tuple(layout.plane_names)
        self.writes: dict[int, tuple[bool, int, int]] = {}
        self.payload: list[dict] = []
        self._journal: list[tuple[int, tuple | None]] = []
        self.copy_buckets = ladder(8, 8, self.num_pages)
        self.restore_buckets = ladder(1, 2, self.num_pages)

    def __len__(self) -> int:
        return len(self.writes)

    def counts(self) -> tuple[int, int]:
        """Pending ``(copies, restores)``: distinct destinations written from device pages and from
        Host payloads."""
        restores = sum(1 for from_payload, _, _ in self.writes.values() if from_payload)
        return len(self.writes) - restores, restores

    def mark(self) -> tuple[int, int]:
        return len(self._journal), len(self.payload)

    def rollback(self, mark: tuple[int, int]) -> None:
        n, m = mark
        while len(self._journal) > n:
            dst, prev = self._journal.pop()
            if prev is None:
                del self.writes[dst]
            else:
                self.writes[dst] = prev
        del self.payload[m:]

    def _put(self, dst: int, entry: tuple) -> None:
        self._journal.append((dst, self.writes.get(dst)))
        self.writes[dst] = entry

    def copy(self, src: int, dst: int, columns: int) -> None:
        """Columns ``[0, columns)`` of device page ``src`` onto ``dst`` (as the device would see them
        after every write recorded so far)."""
        src, dst, columns = int(src), int(dst), int(columns)
        if columns <= 0:
            return
        prev = self.writes.get(src)
        if prev is not None:  # src was written in this work: read what that write reads
            self._put(dst, (prev[0], prev[1], min(columns, prev[2])))
        else:
            self._put(dst, (False, src, columns))

    def restore(self, dst_ids: np.ndarray, pages: Mapping[str, np.ndarray]) -> None:
        """Whole pages from a Host payload: ``pages[name][i]`` (``(layers, H, P, X)``) onto
        ``dst_ids[i]``.  The payload is copied (the Host extent may be reused at once)."""
        for i, dst in enumerate(np.asarray(dst_ids).tolist()):
            self.payload.append({name: np.array(pages[name][i], copy=True) for name in self.names})
            self._put(int(dst), (True, len(self.payload) - 1, PAGE_SIZE))

    def touches(self, pages: np.ndarray) -> bool:
        """Whether a pending write targets one of the device ``pages``."""
        return bool(self.writes) and any(int(p) in self.writes for p in np.asarray(pages).tolist())

    def take(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """The pending writes as bucketed ``copies``, ``restores`` and ``payload``; clears them."""
        n_pages = self.num_pages
        dev = [(d, s, c) for d, (p, s, c) in self.writes.items() if not p]
        host = [(d, s, c) for d, (p, s, c) in self.writes.items() if p]
        k = bucket(len(dev), self.copy_buckets)
        copies = np.zeros((3, k), np.int32)
        copies[1] = n_pages
        if dev:
            copies[:, : len(dev)] = np.array(dev, np.int64)[:, [1, 0, 2]].T
        r = bucket(len(host), self.restore_buckets)
        restores = np.zeros((2, r), np.int32)
        restores[0] = n_pages
        payload = {}
        lay = self.layout
        for spec in lay.planes:
            payload[spec.name] = np.zeros(
                (r, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent), word_dtype(spec.dtype)
            )
        if host:
            arr = np.array(host, np.int64)
            restores[0, : len(host)] = arr[:, 0]
            restores[1, : len(host)] = arr[:, 2]
            for j, (_, s, _) in enumerate(host):
                row = self.payload[s]
                for name, out in payload.items():
                    out[j] = row[name].view(out.dtype)
        self.writes = {}
        self.payload = []
        self._journal = []
        return copies, restores, payload

    def snapshot(self) -> dict:
        return {"writes": sorted(self.writes.items()), "payload": len(self.payload)}
