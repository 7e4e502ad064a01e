"""Retained system-prompt checkpoints and the memory-pressure policy over them.

The cache maps a system prompt (its group index) to the store checkpoint that holds its KV up to
the system-prompt frontier.  It decides nothing about correctness — Move / Fork / COW, restores and
replica validity are the store's — only *which* checkpoint to give up when Device pages run short:

* a victim is a retained checkpoint that no active lane is forking (its pages are then shared
  with nobody), least recently used first, never the checkpoint the caller is about to fork;
* with a Host tier the victim is offloaded (``store.offload_checkpoint``: Device -> Host copy,
  placement "both"; skipped when its Host replica is still valid) and its Device replica dropped
  (``store.drop_device_replica``: placement "host"); a later fork from it restores the pages as a
  stage of ``store.activate``.  When the Host arena cannot take it (``HostCapacityError``), the
  victim is released instead;
* without a Host tier the victim is released (``store.release_checkpoint``); its system prompt is
  recomputed by the next request that needs it.

Host-tier verbs are used only when the store has all of :data:`HOST_VERBS`.
"""

from __future__ import annotations

import dataclasses

from ..store import CheckpointHandle, HostCapacityError, KVStore

__all__ = ["HOST_VERBS", "CachedPrefix", "PrefixCache", "has_host_tier", "host_page_counters"]

HOST_VERBS = ("offload_checkpoint", "drop_device_replica", "restore_checkpoint", "host_occupancy", "host_counters")
"""The store verbs of the Host tier this policy uses (restores happen inside ``activate``)."""


def has_host_tier(store: KVStore) -> bool:
    """Whether ``store`` offers the Host-tier verbs and was built with a Host arena."""
    if not all(callable(getattr(store, verb, None)) for verb in HOST_VERBS):
        return False
    return store.host_occupancy() is not None


def host_page_counters(store: KVStore) -> tuple[int, int]:
    """``(offloaded_pages, restored_pages)`` counted by the store's Host tier, over every pool."""
    if not has_host_tier(store):
        return 0, 0
    counters = store.host_counters()
    return int(counters["offloaded_pages"]), int(counters["restored_pages"])


@dataclasses.dataclass(eq=False)
class CachedPrefix:
    """One retained system-prompt checkpoint.

    Attributes:
      group: the system prompt's index.
      checkpoint: the store's handle.
      frontier: the Main frontier (the system prompt's length).
      last_use: scheduler round of the last retain or fork (LRU key).
      active_forks: lanes forked from it that are still active.
      forks: forks made from it so far.
    """

    group: int
    checkpoint: CheckpointHandle
    frontier: int
    last_use: int
    active_forks: int = 0
    forks: int = 0


@dataclasses.dataclass
class PressureStats:
    offloads: int = 0  # checkpoints moved to Host
    releases: int = 0  # checkpoints given up entirely
    host_full: int = 0  # offloads refused by the Host arena (released instead)


class PrefixCache:
    """System-prompt checkpoints of one store and the victim policy (see the module docstring)."""

    def __init__(self, store: KVStore, state_of=None):
        """``state_of()`` returns the caller's device state with every round work applied (the
        source of an offload's payload); required with a Host tier."""
        self.store = store
        self.state_of = state_of
        self.host_tier = has_host_tier(store)
        self._entries: dict[int, CachedPrefix] = {}
        self.stats = PressureStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, group: int) -> CachedPrefix | None:
        return self._entries.get(group)

    def entries(self) -> list[CachedPrefix]:
        return list(self._entries.values())

    def add(self, group: int, checkpoint: CheckpointHandle, frontier: int, now: int) -> CachedPrefix:
        if group in self._entries:
            raise ValueError(f"system prompt {group} already has a retained checkpoint")
        entry = CachedPrefix(group, checkpoint, int(frontier), now)
        self._entries[group] = entry
        return entry

    # -- residency ---------------------------------------------------------------------------------
    def placement(self, entry: CachedPrefix) -> str:
        """``"device"`` (some page has no Host replica), ``"both"`` or ``"host"`` (some page is
        Host-only); always ``"device"`` without a Host tier."""
        if not self.host_tier:
            return "device"
        return self.store.checkpoint(entry.checkpoint).placement

    def on_device(self, entry: CachedPrefix) -> bool:
        """Whether the checkpoint holds Device pages that giving it up could free."""
        return self.placement(entry) != "host"

    def freeable_pages(self, entry: CachedPrefix) -> int:
        """Main pages that giving up the checkpoint's Device replica would return to the pool."""
        if not self.on_device(entry):
            return 0
        pages = self.store.address_space(entry.checkpoint, "main").pages()
        return sum(1 for p in pages if p.references == 1 and p.device_lease is not None)

    # -- pressure ------------------------------------------------------------------------------------
    def victims(self, exclude: CachedPrefix | None = None) -> list[CachedPrefix]:
        """Evictable checkpoints, least recently used first."""
        out = [
            e
            for e in self._entries.values()
            if e is not exclude and e.active_forks == 0 and self.on_device(e)
        ]
        return sorted(out, key=lambda e: (e.last_use, e.group))

    def evict(self, entry: CachedPrefix) -> str:
        """Give up ``entry``'s Device pages: ``"offloaded"`` (kept on Host) or ``"released"``."""
        if entry.active_forks:
            raise ValueError(f"system prompt {entry.group}: {entry.active_forks} active lane(s) fork it")
        if self.host_tier:
            try:
                if self.placement(entry) == "device":
                    self.store.offload_checkpoint(entry.checkpoint, self.state_of())
                self.store.drop_device_replica(entry.checkpoint)
                self.stats.offloads += 1
                return "offloaded"
            except HostCapacityError:  # the arena cannot take it (store unchanged): release instead
                self.stats.host_full += 1
        self.release(entry)
        return "released"

    def release(self, entry: CachedPrefix) -> None:
        self.store.release_checkpoint(entry.checkpoint)
        del self._entries[entry.group]
        self.stats.releases += 1

    def release_all(self) -> None:
        """Release every checkpoint (end of the run); counted apart from pressure releases."""
        for entry in list(self._entries.values()):
            self.store.release_checkpoint(entry.checkpoint)
        self._entries.clear()

