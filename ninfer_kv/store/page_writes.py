"""PageWrites: one pool's pending page writes between two takes, resolved to pre-work sources.

The COW copies and Host restores a verb records go here; :meth:`PageWrites.take` turns them into
the ``copies``, ``restores`` and ``payload`` of the pool's next :class:`~ninfer_kv.schema.round_work.PoolWork`
(bucketed shapes, padding entries writing nothing).  Every destination is distinct within a work
and every source reads the content the page had *before* the work: a write whose source was itself
written earlier in the same work resolves to that earlier write's source, and a later write to a
destination replaces an earlier one, so the device's one parallel gather-then-scatter equals the
sequential history.
"""

from __future__ import annotations

import sys
from typing import Mapping

import numpy as np

from ..schema.geometry import PAGE_SIZE
from ..host.arena import aligned_empty
from ..host.block_copy import copy_blocks
from ..schema.layout import word_dtype
from ..schema.buckets import bucket, ladder

__all__ = ["PageWrites"]


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _unused(buffers: dict, name: str) -> bool:
    """Whether nothing but its entry in ``buffers`` references ``buffers[name]`` or its memory.

    A work's payload leaf is this very object, and JAX keeps a numpy argument referenced for as
    long as a device buffer made from it (a CPU device reads aligned host memory in place) or a
    computation reading it lives; any other view holds the memory's owner.  So a buffer that
    neither is referenced nor has views can be written again.  (The counts below are exact: no
    local name may hold the buffer while it is counted.)
    """
    if sys.getrefcount(buffers[name]) > 2:  # the dict entry and getrefcount's argument
        return False
    owner = _owner(buffers[name])
    return owner is buffers[name] or sys.getrefcount(owner) <= 3  # the buffer's base, ``owner``, the argument


class PageWrites:
    """Pending page writes of one pool between two takes, resolved to pre-work sources.

    ``writes[dst] = (from_payload, source, columns)``: ``source`` is a device page (content before
    the work) or an entry of the staged payload.  A journal makes every change undoable
    (:meth:`mark` / :meth:`rollback`), for activation and transfer rollbacks.

    Restored pages are staged once: :meth:`restore` copies them from the Host extent straight into
    the payload the next :meth:`take` hands out (per plane one ``(entries, layers, H, P, X)`` word
    buffer, sized to a restore bucket and aligned to the host page, so a CPU device reads it in
    place instead of copying it again).  The take hands the buffers over and starts new ones.
    """

    def __init__(self, layout, num_pages: int):
        self.layout = layout
        self.num_pages = int(num_pages)
        self.names = tuple(layout.plane_names)
        self.writes: dict[int, tuple[bool, int, int]] = {}
        self._journal: list[tuple[int, tuple | None]] = []
        self.copy_buckets = ladder(8, 8, self.num_pages)
        self.restore_buckets = ladder(1, 2, self.num_pages)
        self._staged = 0  # payload entries staged (live or replaced) since the last take
        self._buffers: dict[str, np.ndarray] = {}
        self._retired: list[dict[str, np.ndarray]] = []
        lay = layout
        self._empty = (
            np.zeros((3, 0), np.int32),
            np.zeros((2, 0), np.int32),
            {spec.name: np.zeros((0, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent), word_dtype(spec.dtype))
             for spec in lay.planes},
        )

    def __len__(self) -> int:
        return len(self.writes)

    def counts(self) -> tuple[int, int]:
        """Pending ``(copies, restores)``: distinct destinations written from device pages and from
        Host payloads."""
        restores = sum(1 for from_payload, _, _ in self.writes.values() if from_payload)
        return len(self.writes) - restores, restores

    def mark(self) -> tuple[int, int]:
        return len(self._journal), self._staged

    def rollback(self, mark: tuple[int, int]) -> None:
        n, m = mark
        while len(self._journal) > n:
            dst, prev = self._journal.pop()
            if prev is None:
                del self.writes[dst]
            else:
                self.writes[dst] = prev
        self._staged = m  # entries staged after the mark are no longer referenced

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

    def _payload_rows(self, n: int) -> dict[str, np.ndarray]:
        """Room for ``n`` more staged entries: per plane the rows ``[staged, staged + n)`` of the
        buffers (grown to the next restore bucket, keeping what is staged)."""
        need = self._staged + n
        first = next(iter(self._buffers.values()), None)
        if first is None or first.shape[0] < need:
            rows = bucket(need, self.restore_buckets) if need <= self.restore_buckets[-1] else need
            grown = self._reuse(rows) or self._allocate(rows)
            if self._staged:
                for name, buf in grown.items():
                    buf[: self._staged] = self._buffers[name][: self._staged]
            self._buffers = grown
        return {name: buf[self._staged : need] for name, buf in self._buffers.items()}

    def _allocate(self, rows: int) -> dict[str, np.ndarray]:
        lay = self.layout
        out = {}
        for spec in lay.planes:
            shape = (rows, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent)
            out[spec.name] = aligned_empty(shape, word_dtype(spec.dtype))
        self._retired.append(out)  # kept for reuse once nothing else holds it
        del self._retired[: -self.KEEP]
        return out

    KEEP = 3
    """Payload buffer sets kept for reuse: touching fresh memory (page faults) costs a restore more
    than its copy, so a buffer set handed to a work is reused once the work and every device array
    and computation made from it are gone (:func:`_unused`)."""

    def _reuse(self, rows: int) -> dict[str, np.ndarray] | None:
        for buffers in self._retired:
            size = next(iter(buffers.values())).shape[0]  # no name may hold a buffer while it is counted
            if size == rows and all(_unused(buffers, name) for name in buffers):
                return buffers
        return None

    def restore(self, dst_ids: np.ndarray, pages: Mapping[str, np.ndarray], index=None) -> None:
        """Whole pages from a Host payload onto ``dst_ids``: entry ``i`` is ``pages[name][index[i]]``
        (``index`` default ``range(len(dst_ids))``), each ``(layers, H, P, X)``.  The bytes are
        copied once, into the next take's payload (the Host extent may be reused at once)."""
        dst_ids = np.asarray(dst_ids, np.int64).reshape(-1)
        n = int(dst_ids.size)
        if not n:
            return
        rows = self._payload_rows(n)
        for name, out in rows.items():
            src = pages[name]  # any dtype of the plane's item size: copy_blocks copies bytes
            copy_blocks(out, src[:n] if index is None else src, index)
        first = self._staged
        self._staged += n
        for i, dst in enumerate(dst_ids.tolist()):
            self._put(int(dst), (True, first + i, PAGE_SIZE))

    def touches(self, pages: np.ndarray) -> bool:
        """Whether a pending write targets one of the device ``pages``."""
        return bool(self.writes) and any(int(p) in self.writes for p in np.asarray(pages).tolist())

    def take(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """The pending writes as bucketed ``copies``, ``restores`` and ``payload``; clears them
        (a round without page writes shares one set of empty buffers: nothing to mutate in them).

        The payload is the staged buffers themselves when the live restores are exactly the staged
        entries in order (the usual case: nothing was replaced or rolled back in between), else
        the live entries gathered into new buffers; padding entries' bytes are never read."""
        if not self.writes:
            self._journal = []
            self._staged = 0
            self._buffers = {}
            return self._empty
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
        sources = np.array([s for _, s, _ in host], np.int64)
        if host:
            arr = np.array(host, np.int64)
            restores[0, : len(host)] = arr[:, 0]
            restores[1, : len(host)] = arr[:, 2]
        payload = self._take_payload(sources, r)
        self.writes = {}
        self._journal = []
        self._staged = 0
        self._buffers = {}
        return copies, restores, payload

    def _take_payload(self, sources: np.ndarray, r: int) -> dict:
        lay = self.layout
        have = next(iter(self._buffers.values()), None)
        in_place = have is not None and have.shape[0] == r and np.array_equal(sources, np.arange(sources.size))
        if in_place:
            return dict(self._buffers)
        payload = {}
        for spec in lay.planes:
            out = aligned_empty((r, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent), word_dtype(spec.dtype))
            if sources.size:
                np.take(self._buffers[spec.name], sources, axis=0, out=out[: sources.size])
            out[sources.size :] = 0
            payload[spec.name] = out
        return payload

    def snapshot(self) -> dict:
        return {"writes": sorted(self.writes.items()), "payload": self._staged}
