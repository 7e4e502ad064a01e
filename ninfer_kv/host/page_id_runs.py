"""Physical page-ID runs: the unit of Host <-> Device transfers.

A Host extent stores a pool's pages in *logical* order; their Device replicas may sit at any
physical page IDs.  A transfer walks the logical order and coalesces consecutive entries whose
physical IDs are adjacent (``id[i + 1] == id[i] + 1``) into one run, so a contiguous lease costs
one run and a fully scattered one costs one run per page::

    coalesce_runs([7, 8, 9, 3, 4, 12]) == ([7, 3, 12], [3, 2, 1])

A run is moved by jitted functions whose shapes depend on the run length.  To bound compilation,
:func:`split_runs` cuts each run into pieces whose lengths are powers of two no larger than a
bucket cap (the binary decomposition of the run length, largest first; a run of length ``n``
becomes at most ``popcount(n) + n // cap`` pieces) and groups consecutive single-page pieces into
power-of-two batches, so one copy moves many scattered pages: at most ``2 * log2(cap) + 1``
distinct chunk shapes ever exist per layout and direction.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["coalesce_runs", "check_page_ids", "split_runs", "TransferChunk", "max_bucket_pages"]


def check_page_ids(page_ids, num_pages: int) -> np.ndarray:
    """Validate physical page IDs of one transfer and return them as an int64 vector.

    Requirements: a 1-D sequence of integers, each in ``[0, num_pages)``, without duplicates (a
    page cannot be copied twice within one transfer; on restore two logical pages would race for
    one physical page).  An empty sequence is allowed.
    """
    ids = np.asarray(page_ids)
    if ids.ndim != 1:
        raise ValueError(f"page_ids must be a 1-D sequence of page IDs, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros((0,), np.int64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"page_ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_pages:
        bad = int(ids[(ids < 0) | (ids >= num_pages)][0])
        raise ValueError(f"page ID {bad} is out of range [0, {num_pages}) of the pool's physical pages")
    if np.unique(ids).size != ids.size:
        uniq, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"page ID {int(uniq[counts > 1][0])} appears more than once in one transfer")
    return ids


def coalesce_runs(page_ids) -> tuple[np.ndarray, np.ndarray]:
    """Coalesce physical page IDs, in logical order, into runs of adjacent IDs.

    Returns ``(starts, lengths)`` as int64 vectors: run ``r`` covers physical IDs
    ``starts[r] .. starts[r] + lengths[r] - 1`` and the logical pages
    ``sum(lengths[:r]) .. sum(lengths[:r + 1]) - 1``.  Only ascending adjacency coalesces
    (``[4, 3]`` is two runs): a run is copied as one slice in increasing physical order.
    """
    ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    first = np.concatenate(([0], breaks))
    starts = ids[first]
    lengths = np.diff(np.concatenate((first, [ids.size])))
    return starts, lengths


@dataclasses.dataclass(frozen=True)
class TransferChunk:
    """One copy: ``count = len(physical_starts)`` runs of ``length`` pages each.

    Run ``j`` covers physical IDs ``[physical_starts[j], physical_starts[j] + length)`` and holds the
    logical pages ``logical_start + j * length`` onwards, so a chunk always covers the contiguous
    logical range ``[logical_start, logical_start + pages)`` (one contiguous block of an extent).
    """

    physical_starts: tuple[int, ...]
    logical_start: int
    length: int

    @property
    def count(self) -> int:
        """Runs in the chunk, ``len(physical_starts)``.

        From :func:`split_runs` it is a power of two, greater than 1 only when ``length == 1``.
        """
        return len(self.physical_starts)

    @property
    def pages(self) -> int:
        """Pages the chunk moves, ``length * count``."""
        return self.length * len(self.physical_starts)


def max_bucket_pages(stride: int, max_chunk_bytes: int, max_pages: int = 1024) -> int:
    """Largest power-of-two page count whose payload fits ``max_chunk_bytes`` (at least 1)."""
    if stride < 1:
        raise ValueError(f"page stride must be >= 1 byte, got {stride}")
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    pages = max(1, min(max_pages, max_chunk_bytes // stride))
    return 1 << (pages.bit_length() - 1)


def split_runs(
    starts: np.ndarray, lengths: np.ndarray, bucket_cap: int, max_group: int | None = None
) -> list[TransferChunk]:
    """Cut runs into copies of power-of-two shape, at most ``bucket_cap`` pages each.

    Each run is decomposed into power-of-two pieces of at most ``bucket_cap`` pages, largest first.
    Consecutive single-page pieces (the scattered case) are then grouped, in power-of-two counts of
    at most ``max_group`` (default ``bucket_cap``; ``1`` disables grouping), so that one copy moves
    several one-page runs.  Every chunk has ``length`` and ``count`` powers of two, ``count > 1``
    only when ``length == 1``, hence at most ``2 * log2(bucket_cap) + 1`` distinct chunk shapes
    (``log2(bucket_cap) + 1`` without grouping).  Chunks keep the logical order.
    """
    if bucket_cap < 1 or bucket_cap & (bucket_cap - 1):
        raise ValueError(f"bucket_cap must be a power of two >= 1, got {bucket_cap}")
    max_group = bucket_cap if max_group is None else max_group
    if max_group < 1 or max_group & (max_group - 1) or max_group > bucket_cap:
        raise ValueError(f"max_group must be a power of two in [1, bucket_cap={bucket_cap}], got {max_group}")
    pieces: list[tuple[int, int, int]] = []  # (physical_start, logical_start, length)
    logical = 0
    for start, length in zip(starts.tolist(), lengths.tolist()):
        done = 0
        while done < length:
            remaining = length - done
            n = min(bucket_cap, 1 << (remaining.bit_length() - 1))
            pieces.append((start + done, logical + done, n))
            done += n
        logical += length
    chunks: list[TransferChunk] = []
    i = 0
    while i < len(pieces):
        physical, logical, n = pieces[i]
        if n > 1:
            chunks.append(TransferChunk((physical,), logical, n))
            i += 1
            continue
        j = i
        while j < len(pieces) and pieces[j][2] == 1:
            j += 1
        while i < j:  # singles i..j-1: power-of-two groups, largest first
            g = min(max_group, 1 << ((j - i).bit_length() - 1))
            chunks.append(TransferChunk(tuple(p[0] for p in pieces[i : i + g]), pieces[i][1], 1))
            i += g
    return chunks
