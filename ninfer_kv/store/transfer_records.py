"""Transfer records: what an offload and a restore share — one pool's part of a transfer, its
verification, the transfer report and the fault stages.

A transfer copies a checkpoint's pages between the Device and the Host, one :class:`PoolTransfer`
per pool.  At reservation it records what the copy must preserve (each page's generation, epoch and
committed columns); :meth:`PoolTransfer.verify` runs after the copy and before publication and
refuses (:class:`StaleReplicaError`) when any of that changed, so only valid replicas are ever
published.  The fault-injection points of both state machines are :data:`OFFLOAD_STAGES` and
:data:`RESTORE_STAGES`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Mapping

import numpy as np

from ..schema.errors import LifecycleError, StaleReplicaError
from ..host import HostExtent, TransferReport
from ..schema.kinds import PoolKind
from .runtime import PoolRuntime, RestoreTargets

__all__ = [
    "OFFLOAD_STAGES", "RESTORE_STAGES", "Fault", "HostTransferReport", "PoolTransfer", "pick_pages", "pick_pools",
]

OFFLOAD_STAGES: tuple[str, ...] = ("offload_reserve", "offload_copy", "offload_verify", "offload_publish")
"""Fault-injection points of an offload, in order (``reserve``/``publish`` store-wide, pool ``None``)."""

RESTORE_STAGES: tuple[str, ...] = ("restore_reserve", "restore_copy", "restore_verify", "restore_publish")
"""Fault-injection points of a restore.  Inside activation (stage ``restore_host``) only ``restore_copy``
and ``restore_verify`` are called, per pool: the reservation is the activation's own."""

Fault = Callable[[str, PoolKind | None], None]
"""The store's fault injector: ``fault(stage, pool_or_None)``, called before each stage of a transfer."""


@dataclasses.dataclass(frozen=True)
class HostTransferReport:
    """What one offload or restore of a checkpoint moved, over every pool.

    ``pages``/``bytes``: payload copied; ``runs``: transfer runs (adjacent physical IDs coalesced);
    ``chunks``: copies issued; ``pools``: the per-pool :class:`~ninfer_kv.host.TransferReport`
    (pools with nothing to move are absent).
    """

    direction: str
    pages: int
    bytes: int
    runs: int
    chunks: int
    pools: Mapping[str, TransferReport]

    @staticmethod
    def combine(direction: str, pools: Mapping[str, TransferReport]) -> "HostTransferReport":
        """One report of a transfer in ``direction`` from each pool's
        :class:`~ninfer_kv.host.host_layout.TransferReport` (totals summed, per-pool reports kept)."""
        return HostTransferReport(
            direction=direction,
            pages=sum(r.pages for r in pools.values()),
            bytes=sum(r.bytes for r in pools.values()),
            runs=sum(r.runs for r in pools.values()),
            chunks=sum(r.chunks for r in pools.values()),
            pools=dict(pools),
        )


def pick_pages(kind: PoolKind, rt: PoolRuntime, space: int, verb: str,
               pick: Callable[[np.ndarray], np.ndarray], blocks: int | None = None
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(slots, mask)``: the pages of inactive space ``space`` (its first ``blocks``; ``None``: all,
    in logical order) and ``pick(slots)``, the mask of those ``verb`` moves; ``None`` when it picks
    none.  Refuses (:class:`LifecycleError`, nothing changed) when a picked page is pinned by an
    in-flight copy."""
    slots = rt.spaces.pages_of(space)[:blocks].copy()
    mask = pick(slots)
    if not mask.any():
        return None
    pinned = np.flatnonzero((rt.pages.pins[slots] * mask) != 0)
    if pinned.size:
        raise LifecycleError(
            f"pool {kind.value}: {verb} refused: logical blocks {pinned.tolist()} are pinned by an in-flight copy"
        )
    return slots, mask


def pick_pools(runtimes: Mapping[PoolKind, PoolRuntime], spaces: Mapping[PoolKind, int], verb: str,
               pick: Callable[[PoolRuntime, np.ndarray], np.ndarray]
               ) -> Iterator[tuple[PoolKind, PoolRuntime, np.ndarray, np.ndarray]]:
    """:func:`pick_pages` over every pool of checkpoint ``spaces = {PoolKind: inactive space slot}``:
    ``(kind, runtime, slots, mask)`` for each pool where ``pick(runtime, slots)`` picks a page, in
    pool order (a pinned picked page refuses the verb when its pool is reached)."""
    for kind, space in spaces.items():
        rt = runtimes[kind]
        picked = pick_pages(kind, rt, space, verb, lambda slots: pick(rt, slots))
        if picked is not None:
            yield kind, rt, *picked


@dataclasses.dataclass(eq=False)
class PoolTransfer:
    """One pool's part of a transfer: the pages, what the copy must preserve, what it produced.

    ``slots`` are the pages to copy in logical order, ``blocks`` their logical blocks in the
    checkpoint (for messages); ``columns``, ``epochs`` and ``generations`` are their committed
    columns, epochs and descriptor generations at reservation.  An offload fills ``ids``/``id_gens``
    (the Device leases it reads) and ``extent`` (the Host extent it writes); a restore fills
    ``targets`` (the Device pages it writes).
    """

    kind: PoolKind
    rt: PoolRuntime
    slots: np.ndarray
    blocks: np.ndarray
    columns: np.ndarray
    epochs: np.ndarray
    generations: np.ndarray
    ids: np.ndarray | None = None
    id_gens: np.ndarray | None = None
    extent: HostExtent | None = None
    targets: RestoreTargets | None = None
    report: TransferReport | None = None

    @classmethod
    def of(cls, kind: PoolKind, rt: PoolRuntime, slots: np.ndarray, mask: np.ndarray) -> "PoolTransfer":
        """The transfer of the pages ``slots[mask]`` (``mask`` over the checkpoint's logical blocks)."""
        pg = rt.pages
        sel = slots[mask]
        return cls(kind=kind, rt=rt, slots=sel, blocks=np.flatnonzero(mask), columns=rt.page_committed(sel),
                   epochs=pg.epoch[sel].copy(), generations=pg.generation[sel].copy())

    @property
    def stride(self) -> int:
        """Bytes of one page of this pool in a Host extent."""
        return self.rt.host_replicas.layout.stride

    def verify(self, *, restore: bool) -> None:
        """The copy's pages still hold the content they held at reservation, and the source is intact
        (:class:`StaleReplicaError` otherwise: the replica is not published)."""
        rt, s = self.rt, self.slots
        pg = rt.pages
        same = pg.live[s] & (pg.generation[s] == self.generations) & (pg.writer[s] < 0)
        epoch_now = pg.epoch[s]
        cols_now = rt.page_committed(s)
        same &= (epoch_now == self.epochs) & (cols_now == self.columns)
        if restore:  # the Host source is still a valid replica, the page still has no Device replica
            same &= pg.host_valid(s, self.columns) & (pg.device_page[s] < 0)
        else:  # the Device source is the same lease
            same &= (pg.device_page[s] == self.ids) & (pg.device_gen[s] == self.id_gens)
        if not same.all():
            i = int(np.flatnonzero(~same)[0])
            raise StaleReplicaError(
                f"pool {self.kind.value}: logical block {int(self.blocks[i])} changed during the copy (epoch "
                f"{int(self.epochs[i])} -> {int(epoch_now[i])}, committed columns {int(self.columns[i])} -> "
                f"{int(cols_now[i])}); the replica is not published"
            )
