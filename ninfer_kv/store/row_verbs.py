"""Mapping, commit, trim and settlement: the verb family of a unit's frontiers.

Handle verbs (``ensure_mapped_to_tokens``, ``commit``, ``trim``, ``truncate``, ``settle``) name one
sequence; the vectorized row verbs (``map_rows``, ``commit_rows``, ``trim_rows``, ``settle_rows``,
``round_boundary``) take numpy (or any integer array-like) vectors of execution rows for a decode
round, with no Python loop per lane.  Both go through the one row validation of
:class:`~ninfer_kv.store.rows.ExecutionRows`.
"""

from __future__ import annotations

import numpy as np

from ..geometry import PAGE_SIZE
from ..planning import PoolKind
from .bundle import SequenceHandle
from .entitlement import RoundGrant, pages_for_tokens
from .errors import LifecycleError
from .rows import as_index as _int
from .rows import as_index_vector as _vec

__all__ = ["RowVerbs"]


def _same_length(rows: np.ndarray, **others: np.ndarray) -> None:
    for name, arr in others.items():
        if arr.shape != rows.shape:
            raise ValueError(f"rows {rows.shape} and {name} {arr.shape} must be 1-D of one length")


class RowVerbs:
    """Frontier verbs of :class:`~ninfer_kv.store.KVStore`."""

    def ensure_mapped_to_tokens(self, handle: SequenceHandle, tokens: int, *, pool="main") -> int:
        """Make the sequence's membership in ``pool`` cover ``tokens`` tokens (a lower bound).

        A no-op when the membership already covers ``tokens`` (even if it covers more).  Fails, with
        nothing changed, only when ``tokens`` exceeds the entitlement.  Never advances a frontier,
        never trims, never changes the entitlement.  Returns the number of pages materialized.
        """
        rows = self._handle_row(handle, "ensure_mapped_to_tokens")
        tokens = _int("tokens", tokens)
        return self._runtime(pool).map_rows(rows, np.array([tokens], np.int64))

    def commit(self, handle: SequenceHandle, frontier: int, *, pool="main") -> None:
        """Advance the committed frontier after a unit succeeded (within the mapped extent)."""
        rows = self._handle_row(handle, "commit")
        frontier = _int("frontier", frontier)
        self._runtime(pool).commit_rows(rows, np.array([frontier], np.int64))

    def trim(self, handle: SequenceHandle, *, pool="main", provisional: int = 0) -> int:
        """Keep ``ceil(max(committed, provisional) / P)`` pages; leases return to the reservation."""
        rows = self._handle_row(handle, "trim")
        provisional = _int("provisional", provisional)
        return self._runtime(pool).trim_rows(rows, np.array([provisional], np.int64))

    def truncate(self, handle: SequenceHandle, frontier: int, *, pool="main", provisional: int = 0) -> None:
        """Lower the committed frontier to ``frontier`` (not below the protected frontier), then trim.

        A sequence quarantined by a resync may be truncated to at most the intact frontier the resync
        reported for ``pool``; once no pool commits beyond its intact frontier the sequence returns
        to service (its block-table rows are published again)."""
        rec = self._sequence(handle)
        row = rec.row
        rt = self._runtime(pool)
        frontier = _int("frontier", frontier)
        provisional = _int("provisional", provisional)
        if rec.lost is None:
            self._handle_row(handle, "truncate")
        elif frontier > rec.lost[rt.kind]:
            raise self._lost_error(handle, rec, f"truncate of pool {rt.kind.value} to {frontier} (above its intact "
                                                f"frontier)")
        lo, hi = int(rt.spaces.protected[row]), int(rt.spaces.committed[row])
        if not lo <= frontier <= hi:
            raise LifecycleError(
                f"pool {rt.kind.value}: truncate frontier {frontier} is outside [{lo}, {hi}] (protected frontier, "
                f"committed frontier)"
            )
        rt.truncate_row(row, frontier, provisional)
        self._revive_if_intact(rec)

    def settle(self, handle: SequenceHandle, accepted_frontier: int, *, pool="main", provisional: int | None = None):
        """Speculative settlement: commit the accepted frontier, then trim rejected trailing pages.

        ``provisional`` keeps mappings up to that many tokens (e.g. the next round's draft window).
        """
        rows = self._handle_row(handle, "settle")
        accepted_frontier = _int("accepted_frontier", accepted_frontier)
        keep = accepted_frontier if provisional is None else _int("provisional", provisional)
        self._runtime(pool).settle_rows(rows, np.array([accepted_frontier], np.int64), np.array([keep], np.int64))

    # -- vectorized row verbs (decode rounds) ------------------------------------------------------------------
    def map_rows(self, rows, targets, *, pool=PoolKind.MAIN) -> int:
        """Vectorized ``ensure_mapped_to_tokens`` over execution rows; returns pages materialized."""
        rt = self._runtime(pool)
        rows = self._rows.check(rows)
        targets = _vec("targets", targets)
        _same_length(rows, targets=targets)
        return rt.map_rows(rows, targets)

    def commit_rows(self, rows, frontiers, *, pool=PoolKind.MAIN) -> None:
        """Vectorized ``commit`` over execution rows."""
        rt = self._runtime(pool)
        rows = self._rows.check(rows)
        frontiers = _vec("frontiers", frontiers)
        _same_length(rows, frontiers=frontiers)
        rt.commit_rows(rows, frontiers)

    def trim_rows(self, rows, keep_tokens=None, *, pool=PoolKind.MAIN) -> int:
        """Vectorized ``trim``: keep ``ceil(max(committed, keep_tokens) / P)`` pages per row."""
        rt = self._runtime(pool)
        rows = self._rows.check(rows)
        keep = np.zeros_like(rows) if keep_tokens is None else _vec("keep_tokens", keep_tokens)
        _same_length(rows, keep_tokens=keep)
        return rt.trim_rows(rows, keep)

    def settle_rows(self, rows, accepted, provisional=None, *, pool=PoolKind.MAIN) -> int:
        """Vectorized ``settle``: commit accepted frontiers, then trim to ``max(accepted, provisional)``."""
        rt = self._runtime(pool)
        rows = self._rows.check(rows)
        accepted = _vec("accepted", accepted)
        keep = accepted if provisional is None else _vec("provisional", provisional)
        _same_length(rows, accepted=accepted, provisional=keep)
        return rt.settle_rows(rows, accepted, keep)

    def round_boundary(self, rows=None, *, step_tokens: int = 1) -> RoundGrant:
        """Grow ``kv_lease_growth`` entitlements at a decode-round boundary (vectorized).

        Each lane wants ``min(target, committed + window + cushion)`` Main tokens (plus each pool's
        lead), granted from available pages in row order.  A lane whose entitlement cannot cover its
        next ``step_tokens`` tokens is ``length_limited``: end it with finish reason ``length``.
        Lanes with a full entitlement never change.
        """
        main = self._main
        rows = self._rows.active() if rows is None else self._rows.check(rows)
        step = _int("step_tokens", step_tokens, 1)
        committed = main.spaces.committed[rows]
        target = main.spaces.target[rows]
        growth = main.spaces.growth[rows]
        desired = np.where(growth, self.policy.desired_tokens(committed, target), 0)
        cap = self.logical_pages * PAGE_SIZE
        granted = {}
        covered = target.copy()
        for kind, rt in self._rt.items():
            want = pages_for_tokens(np.minimum(cap, desired + rt.lead_tokens * (desired > 0)))
            granted[kind] = rt.grow(rows, want)
            pool_cover = rt.spaces.ent_pages[rows] * PAGE_SIZE - rt.lead_tokens
            covered = np.minimum(covered, pool_cover)
        limited = covered < np.minimum(target, committed + step)
        return RoundGrant(rows=rows, covered_tokens=covered, length_limited=limited, granted_pages=granted)

