"""Mapping, commit, trim and settlement: the verb family of a unit's frontiers.

Handle verbs (``ensure_mapped_to_tokens``, ``commit``, ``trim``, ``truncate``, ``settle``) name one
sequence; the vectorized row verbs (``map_rows``, ``commit_rows``, ``trim_rows``, ``settle_rows``,
``round_boundary``) take numpy (or any integer array-like) vectors of execution rows for a decode
round, with no Python loop per lane.  Both go through the one row validation of
:class:`~ninfer_kv.store.rows.ExecutionRows` and the one target rule of
:func:`~ninfer_kv.store.rows.check_targets`.
"""

from __future__ import annotations

import numpy as np

from ..geometry import PAGE_SIZE
from ..kinds import PoolKind
from .bundle import SequenceHandle
from .entitlement import RoundGrant, pages_for_tokens
from ..errors import LifecycleError
from .rows import as_index as _int
from .rows import as_integer, check_targets
from .core import StoreCore

__all__ = ["RowVerbs"]


class RowVerbs:
    """Frontier verbs of :class:`~ninfer_kv.store.KVStore`.

    One rule for every target (map target, frontier, kept tokens), in row verbs and handle verbs
    alike: an integer (``TypeError`` otherwise) in ``[0, L * P]`` (else :class:`TargetError` naming the
    row and the value); then each verb's own limits (the entitlement, ``[committed, mapped]``, the
    protected frontier).  Each row verb has a public ``check_*`` twin that raises exactly what the verb
    would raise and changes nothing, so a caller can validate several calls (every shard of a
    :class:`ShardedKVStore`) before applying any.
    """

    def __init__(self, core: StoreCore):
        self.core = core

    # -- validation -----------------------------------------------------------------------------------------
    def check_rows(self, rows) -> np.ndarray:
        """The one row validation of every row verb: ``rows`` as ``int64``, each leased to an active
        (not quarantined) sequence, none twice; else :class:`RowError` (or ``TypeError`` for a
        non-integer array) naming the first bad row.  Changes nothing."""
        return self.core.rows.check(rows)

    def _targets(self, name: str, rows: np.ndarray, values) -> np.ndarray:
        return check_targets(name, rows, values, self.core.logical_pages * PAGE_SIZE)

    def check_map_rows(self, rows, targets, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`map_rows` call (raises what it would raise; changes nothing); returns the
        ``(runtime, rows, targets)`` it would apply."""
        return self._checked_map(rows, targets, pool)[:3]

    def _checked_map(self, rows, targets, pool) -> tuple:
        rt = self.core.runtime(pool)
        rows = self.core.rows.check(rows)
        targets = self._targets("targets", rows, targets)
        return rt, rows, targets, rt.check_map(rows, targets)

    def check_commit_rows(self, rows, frontiers, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`commit_rows` call (see :meth:`check_map_rows`)."""
        return self._checked_commit(rows, frontiers, pool)[:3]

    def _checked_commit(self, rows, frontiers, pool) -> tuple:
        rt = self.core.runtime(pool)
        rows = self.core.rows.check(rows)
        frontiers = self._targets("frontiers", rows, frontiers)
        return rt, rows, frontiers, rt.check_commit(rows, frontiers)

    def check_trim_rows(self, rows, keep_tokens=None, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`trim_rows` call (see :meth:`check_map_rows`)."""
        rt = self.core.runtime(pool)
        rows = self.core.rows.check(rows)
        keep = np.zeros_like(rows) if keep_tokens is None else self._targets("keep_tokens", rows, keep_tokens)
        rt.check_trim(rows, keep)
        return rt, rows, keep

    def check_settle_rows(self, rows, accepted, provisional=None, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`settle_rows` call (see :meth:`check_map_rows`)."""
        rt = self.core.runtime(pool)
        rows = self.core.rows.check(rows)
        accepted = self._targets("accepted", rows, accepted)
        keep = accepted if provisional is None else self._targets("provisional", rows, provisional)
        rt.check_commit(rows, accepted)
        rt.check_trim(rows, keep, committed=accepted)
        return rt, rows, accepted, keep

    def _one(self, name: str, value) -> np.ndarray:
        return np.array([as_integer(name, value)], np.int64)

    # -- handle verbs ---------------------------------------------------------------------------------------
    def ensure_mapped_to_tokens(self, handle: SequenceHandle, tokens: int, *, pool="main") -> int:
        """Make the sequence's membership in ``pool`` cover ``tokens`` tokens (a lower bound).

        A no-op when the membership already covers ``tokens`` (even if it covers more).  Fails, with
        nothing changed, when ``tokens`` is out of range (:class:`TargetError`) or exceeds the
        entitlement (:class:`EntitlementError`).  Never advances a frontier, never trims, never
        changes the entitlement.  Returns the number of pages materialized.
        """
        rows = self.core.handle_row(handle, "ensure_mapped_to_tokens")
        rt, rows, targets = self.check_map_rows(rows, self._one("tokens", tokens), pool=pool)
        return rt.map_rows(rows, targets)

    def commit(self, handle: SequenceHandle, frontier: int, *, pool="main") -> None:
        """Advance the committed frontier after a unit succeeded (within the mapped extent)."""
        rows = self.core.handle_row(handle, "commit")
        rt, rows, frontiers = self.check_commit_rows(rows, self._one("frontier", frontier), pool=pool)
        rt.commit_rows(rows, frontiers)

    def trim(self, handle: SequenceHandle, *, pool="main", provisional: int = 0) -> int:
        """Keep ``ceil(max(committed, provisional) / P)`` pages; leases return to the reservation."""
        rows = self.core.handle_row(handle, "trim")
        rt, rows, keep = self.check_trim_rows(rows, self._one("provisional", provisional), pool=pool)
        return rt.trim_rows(rows, keep)

    def truncate(self, handle: SequenceHandle, frontier: int, *, pool="main", provisional: int = 0) -> None:
        """Lower the committed frontier to ``frontier`` (not below the protected frontier), then trim.

        A sequence quarantined by a resync may be truncated to at most the intact frontier the resync
        reported for ``pool``; once no pool commits beyond its intact frontier the sequence returns
        to service (its block-table rows are published again)."""
        rec = self.core.sequence_record(handle)
        row = rec.row
        rt = self.core.runtime(pool)
        rows = np.array([row], np.int64)
        frontier = int(self._targets("frontier", rows, self._one("frontier", frontier))[0])
        provisional = int(self._targets("provisional", rows, self._one("provisional", provisional))[0])
        if rec.lost is None:
            self.core.handle_row(handle, "truncate")
        elif frontier > rec.lost[rt.kind]:
            raise self.core.lost_error(handle, rec, f"truncate of pool {rt.kind.value} to {frontier} (above its intact "
                                                f"frontier)")
        lo, hi = int(rt.spaces.protected[row]), int(rt.spaces.committed[row])
        if not lo <= frontier <= hi:
            raise LifecycleError(
                f"pool {rt.kind.value}: truncate frontier {frontier} is outside [{lo}, {hi}] (protected frontier, "
                f"committed frontier)"
            )
        rt.check_trim(rows, np.array([provisional], np.int64), committed=np.array([frontier], np.int64))
        rt.truncate_row(row, frontier, provisional)
        self.core.revive_if_intact(rec)

    def settle(self, handle: SequenceHandle, accepted_frontier: int, *, pool="main", provisional: int | None = None):
        """Speculative settlement: commit the accepted frontier, then trim rejected trailing pages.

        ``provisional`` keeps mappings up to that many tokens (e.g. the next round's draft window).
        """
        rows = self.core.handle_row(handle, "settle")
        accepted = self._one("accepted_frontier", accepted_frontier)
        keep = None if provisional is None else self._one("provisional", provisional)
        rt, rows, accepted, keep = self.check_settle_rows(rows, accepted, keep, pool=pool)
        rt.settle_rows(rows, accepted, keep)

    # -- vectorized row verbs (decode rounds) ------------------------------------------------------------------
    def map_rows(self, rows, targets, *, pool=PoolKind.MAIN) -> int:
        """Vectorized ``ensure_mapped_to_tokens`` over execution rows; returns pages materialized."""
        rt, rows, targets, crossing = self._checked_map(rows, targets, pool)
        return rt.map_rows(rows, targets, crossing)

    def commit_rows(self, rows, frontiers, *, pool=PoolKind.MAIN) -> None:
        """Vectorized ``commit`` over execution rows."""
        rt, rows, frontiers, committed = self._checked_commit(rows, frontiers, pool)
        rt.commit_rows(rows, frontiers, committed)

    def trim_rows(self, rows, keep_tokens=None, *, pool=PoolKind.MAIN) -> int:
        """Vectorized ``trim``: keep ``ceil(max(committed, keep_tokens) / P)`` pages per row."""
        rt, rows, keep = self.check_trim_rows(rows, keep_tokens, pool=pool)
        return rt.trim_rows(rows, keep)

    def settle_rows(self, rows, accepted, provisional=None, *, pool=PoolKind.MAIN) -> int:
        """Vectorized ``settle``: commit accepted frontiers, then trim to ``max(accepted, provisional)``."""
        rt, rows, accepted, keep = self.check_settle_rows(rows, accepted, provisional, pool=pool)
        return rt.settle_rows(rows, accepted, keep)

    def round_boundary(self, rows=None, *, step_tokens: int = 1) -> RoundGrant:
        """Grow ``kv_lease_growth`` entitlements at a decode-round boundary (vectorized).

        Each lane wants ``min(target, committed + window + cushion)`` Main tokens (plus each pool's
        lead), granted from available pages in row order.  A lane whose entitlement cannot cover its
        next ``step_tokens`` tokens is ``length_limited``: end it with finish reason ``length``.
        Lanes with a full entitlement never change.
        """
        main = self.core.main
        rows = self.core.rows.active() if rows is None else self.core.rows.check(rows)
        step = _int("step_tokens", step_tokens, 1)
        committed = main.spaces.committed[rows]
        target = main.spaces.target[rows]
        growth = main.spaces.growth[rows]
        desired = np.where(growth, self.core.policy.desired_tokens(committed, target), 0)
        cap = self.core.logical_pages * PAGE_SIZE
        granted = {}
        covered = target.copy()
        for kind, rt in self.core.runtimes.items():
            want = pages_for_tokens(np.minimum(cap, desired + rt.lead_tokens * (desired > 0)))
            granted[kind] = rt.grow(rows, want)
            pool_cover = rt.spaces.ent_pages[rows] * PAGE_SIZE - rt.lead_tokens
            covered = np.minimum(covered, pool_cover)
        limited = covered < np.minimum(target, committed + step)
        return RoundGrant(rows=rows, covered_tokens=covered, length_limited=limited, granted_pages=granted)

