"""The engine's prefix cache: retained checkpoints indexed by their token ids, and eviction.

Every finished sequence (and every aborted one, at its committed frontier) is retained as a store
checkpoint and indexed by the token ids its KV holds (:class:`~ninfer_kv.engine.prefix_index.PrefixIndex`),
so a later request reuses *exactly* its longest cached prefix, at any token: the store forks the
checkpoint at that frontier (full pages shared, the partial tail copied).  A checkpoint whose
tokens another one extends is redundant for matching and is released when the longer one arrives
(unless a running request still forks it).

Eviction, when an admission needs Device pages: the least recently used entries that no running
request uses (:meth:`PrefixIndex.eviction_order`), one at a time.  With a Host tier an entry is
first offloaded (Device -> Host copy, then its Device replica dropped; a later hit restores it
inside the activation), and released when the Host arena cannot take it or an active sequence
reads some of its pages (those stay on Device); without one it is released.  Entries whose pages
are all Host-only free no Device page and are skipped (the pages a hit restored are on Device
again); when the arena is full, the least recently used Host-only entries are released to make room.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from ..schema.errors import HostCapacityError, LifecycleError
from ..store import CheckpointHandle, KVStore
from .prefix_index import PrefixEntry, PrefixIndex

__all__ = ["CacheStats", "PrefixCache"]


@dataclasses.dataclass
class CacheStats:
    """Counters of the prefix cache.

    Attributes:
      hits: admissions that forked a cached prefix; hit_tokens: the prompt tokens they reused.
      inserted: checkpoints indexed; redundant: finished sequences not kept (a cached one covers them).
      offloaded: entries moved to the Host tier; released: entries given up entirely.
      host_full: offloads refused because the Host arena could not make room (the entry was
        released instead).
    """

    hits: int = 0
    hit_tokens: int = 0
    inserted: int = 0
    redundant: int = 0
    offloaded: int = 0
    released: int = 0
    host_full: int = 0


class PrefixCache:
    """Checkpoints of one store indexed by token ids (module docstring).

    Args:
      store: the store whose checkpoints are cached.
      offload: ``offload(checkpoint)`` moves a retained checkpoint's pages to the Host tier
        (the runner's :func:`~ninfer_kv.device.offload_gather.offload_checkpoint` from its flushed state);
        used only with a Host tier.
      release: ``release(checkpoint)`` gives a checkpoint up (default ``store.release_checkpoint``;
        the engine's also frees a ring snapshot slot).
    """

    def __init__(self, store: KVStore, offload: Callable[[object], object],
                 release: Callable[[object], None] | None = None):
        self.store = store
        self.offload = offload
        self.release = store.release_checkpoint if release is None else release
        self.index = PrefixIndex()
        self.host_tier = store.host_occupancy() is not None
        self.stats = CacheStats()
        self._hidden: dict = {}  # entry -> the hidden states kept with it (speculative engines)

    def __len__(self) -> int:
        return len(self.index)

    # -- lookup ---------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens[:limit]`` and that length."""
        return self.index.longest_match(tokens, limit)

    # -- insertion --------------------------------------------------------------------------------------
    def hidden_of(self, entry: PrefixEntry | None):
        """The hidden states kept with ``entry`` (``None`` without)."""
        return None if entry is None else self._hidden.get(entry)

    def keep(self, tokens: Sequence[int], checkpoint: CheckpointHandle, now: int, *,
             hidden=None) -> PrefixEntry | None:
        """Index a retained ``checkpoint`` holding ``tokens`` (with a speculative model's ``hidden``
        states of those tokens); release it instead when a cached entry already covers them.
        Entries the new one makes redundant are released (unless pinned)."""
        cover = self.index.covering(tokens)
        if cover is not None:
            self.release(checkpoint)
            self.index.touch(cover, now)
            self.stats.redundant += 1
            return None
        for old in self.index.covered(tokens):
            if old.pins == 0:
                self._release(old)
        entry = self.index.insert(tokens, checkpoint, now=now)
        if hidden is not None:
            self._hidden[entry] = hidden
        self.stats.inserted += 1
        return entry

    # -- pressure ----------------------------------------------------------------------------------------
    def evict_one(self, exclude: PrefixEntry | None = None) -> bool:
        """Free Device pages by giving up one entry (module docstring); ``False`` when none can be."""
        for entry in self.index.eviction_order():
            if entry is exclude or not self._on_device(entry):
                continue
            if self.host_tier and self._offload(entry, exclude):
                return True
            self._release(entry)
            return True
        return False

    def _on_device(self, entry: PrefixEntry) -> bool:
        """Whether ``entry`` holds Device pages (placement ``"host"`` still may: the pages a hit
        restored have both replicas)."""
        if not self.host_tier:
            return True
        info = self.store.checkpoint(entry.value)
        return info.placement != "host" or info.page_placement.get("both", 0) > 0

    def _offload(self, entry: PrefixEntry, exclude: PrefixEntry | None) -> bool:
        """Move ``entry`` to the Host tier, releasing Host-only entries while the arena is full;
        ``False`` when it cannot move (the arena is full of pinned entries, or an active sequence
        reads some of its pages, which stay on Device)."""
        while True:
            try:
                if self.store.checkpoint(entry.value).placement == "device":
                    self.offload(entry.value)
                self.store.drop_device_replica(entry.value)
                self.stats.offloaded += 1
                return True
            except LifecycleError:  # a page shared with an active sequence: the caller releases it
                return False
            except HostCapacityError:
                hosted = [e for e in self.index.eviction_order()
                          if e is not exclude and e is not entry and not self._on_device(e)]
                if not hosted:
                    self.stats.host_full += 1
                    return False
                self._release(hosted[0])

    def release_lru(self, wanted: Callable[[PrefixEntry], bool]) -> bool:
        """Release the least recently used unpinned entry for which ``wanted(entry)`` holds; ``False``
        when there is none."""
        for entry in self.index.eviction_order():
            if wanted(entry):
                self._release(entry)
                return True
        return False

    def _release(self, entry: PrefixEntry) -> None:
        self.forget(entry)
        self.release(entry.value)
        self.stats.released += 1

    def forget(self, entry: PrefixEntry) -> None:
        """Take ``entry`` out of the index (its checkpoint is the caller's to release)."""
        self._hidden.pop(entry, None)
        self.index.remove(entry)

    def clear(self) -> int:
        """Release every unpinned entry; returns how many were released."""
        victims = [e for e in self.index.eviction_order()]
        for entry in victims:
            self._release(entry)
        return len(victims)
