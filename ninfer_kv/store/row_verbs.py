"""Mapping, commit, trim and settlement: the verb family of a unit's frontiers.

One family: ``map``, ``commit``, ``trim`` and ``settle`` take either numpy (or any integer
array-like) vectors of execution rows and per-row values, for a decode round with no Python loop
per lane, or one :class:`~ninfer_kv.store.bundle.SequenceHandle` and one integer.  Both forms go
through the one row validation of :class:`~ninfer_kv.store.rows.ExecutionRows` and the one target
rule of :func:`~ninfer_kv.store.rows.check_targets`; each verb has a ``check_*`` twin that raises
exactly what it would and changes nothing.  ``truncate`` (a repair of one sequence) and
``round_boundary`` (lease growth) complete the family.
"""

from __future__ import annotations

import numpy as np

from ..schema.geometry import PAGE_SIZE
from ..schema.kinds import PoolKind
from .bundle import SequenceHandle
from .entitlement import RoundGrant, pages_for_tokens
from ..schema.errors import LifecycleError
from .rows import as_index as _int
from .rows import as_integer, check_targets
from .core import StoreCore

__all__ = ["RowVerbs"]


class RowVerbs:
    """Frontier verbs of :class:`~ninfer_kv.store.KVStore`.

    One rule for every target (map target, frontier, kept tokens), given by rows or by handle
    alike: an integer (``TypeError`` otherwise) in ``[0, L * P]`` (else :class:`TargetError` naming the
    row and the value); then each verb's own limits (the entitlement, ``[committed, mapped]``, the
    protected frontier).  Each verb has a public ``check_*`` twin that raises exactly what the verb
    would raise and changes nothing, so a caller can validate several calls (every shard of a
    :class:`ShardedKVStore`) before applying any.
    """

    _core: StoreCore

    # -- validation -----------------------------------------------------------------------------------------
    def check_rows(self, rows) -> np.ndarray:
        """The one row validation of every row verb: ``rows`` as ``int64``, each leased to an active
        (not quarantined) sequence, none twice; else :class:`RowError` (or ``TypeError`` for a
        non-integer array) naming the first bad row.  Changes nothing."""
        return self._core.rows.check(rows)

    def _targets(self, name: str, rows: np.ndarray, values) -> np.ndarray:
        return check_targets(name, rows, values, self._core.logical_pages * PAGE_SIZE)

    def _lanes(self, verb: str, rows, *values: tuple[str, object]) -> tuple:
        """``(rows, values)``: a :class:`SequenceHandle` becomes its one-row vector (through the
        handle's own checks, naming ``verb``) and each of its integer values a one-element vector."""
        if isinstance(rows, SequenceHandle):
            rows = self._core.handle_row(rows, verb)
            return rows, [None if v is None else self._one(name, v) for name, v in values]
        return rows, [v for _, v in values]

    def check_map(self, rows, targets, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`map` call (raises what it would raise; changes nothing); returns the
        ``(runtime, rows, targets)`` it would apply."""
        return self._checked_map(rows, targets, pool)[:3]

    def _checked_map(self, rows, targets, pool) -> tuple:
        rows, (targets,) = self._lanes("map", rows, ("tokens", targets))
        rt = self._core.runtime(pool)
        rows = self._core.rows.check(rows)
        targets = self._targets("targets", rows, targets)
        return rt, rows, targets, rt.check_map(rows, targets)

    def check_commit(self, rows, frontiers, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`commit` call (see :meth:`check_map`)."""
        return self._checked_commit(rows, frontiers, pool)[:3]

    def _checked_commit(self, rows, frontiers, pool) -> tuple:
        rows, (frontiers,) = self._lanes("commit", rows, ("frontier", frontiers))
        rt = self._core.runtime(pool)
        rows = self._core.rows.check(rows)
        frontiers = self._targets("frontiers", rows, frontiers)
        return rt, rows, frontiers, rt.check_commit(rows, frontiers)

    def check_trim(self, rows, keep_tokens=None, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`trim` call (see :meth:`check_map`)."""
        rows, (keep_tokens,) = self._lanes("trim", rows, ("keep_tokens", keep_tokens))
        rt = self._core.runtime(pool)
        rows = self._core.rows.check(rows)
        keep = np.zeros_like(rows) if keep_tokens is None else self._targets("keep_tokens", rows, keep_tokens)
        rt.check_trim(rows, keep)
        return rt, rows, keep

    def check_settle(self, rows, accepted, provisional=None, *, pool=PoolKind.MAIN) -> tuple:
        """Validate a :meth:`settle` call (see :meth:`check_map`)."""
        rows, (accepted, provisional) = self._lanes("settle", rows, ("accepted", accepted), ("provisional", provisional))
        rt = self._core.runtime(pool)
        rows = self._core.rows.check(rows)
        accepted = self._targets("accepted", rows, accepted)
        keep = accepted if provisional is None else self._targets("provisional", rows, provisional)
        rt.check_commit(rows, accepted)
        rt.check_trim(rows, keep, committed=accepted)
        return rt, rows, accepted, keep

    def _one(self, name: str, value) -> np.ndarray:
        return np.array([as_integer(name, value)], np.int64)

    # -- the verbs ------------------------------------------------------------------------------------------
    def map(self, rows, targets, *, pool=PoolKind.MAIN) -> int:
        """Make each row's membership in ``pool`` cover its target tokens (a lower bound).

        ``rows``: execution rows with a ``targets`` vector, or one :class:`SequenceHandle` with one
        integer.  A no-op for a row whose membership already covers its target (even if it covers
        more).  Fails, with nothing changed, when a target is out of range (:class:`TargetError`) or
        exceeds the entitlement (:class:`EntitlementError`).  Never advances a frontier, never trims,
        never changes the entitlement.  Returns the number of pages materialized.
        """
        rt, rows, targets, crossing = self._checked_map(rows, targets, pool)
        return rt.map_rows(rows, targets, crossing)

    def commit(self, rows, frontiers, *, pool=PoolKind.MAIN) -> None:
        """Advance each row's committed frontier after a unit succeeded (within the mapped extent).

        ``rows``: execution rows with a ``frontiers`` vector, or one :class:`SequenceHandle` with one
        integer."""
        rt, rows, frontiers, committed = self._checked_commit(rows, frontiers, pool)
        rt.commit_rows(rows, frontiers, committed)

    def trim(self, rows, keep_tokens=None, *, pool=PoolKind.MAIN) -> int:
        """Keep ``ceil(max(committed, keep_tokens) / P)`` pages per row; leases return to the
        reservation.  ``rows``: execution rows (``keep_tokens`` a vector or ``None``) or one
        :class:`SequenceHandle` (``keep_tokens`` an integer or ``None``).  Returns the pages freed."""
        rt, rows, keep = self.check_trim(rows, keep_tokens, pool=pool)
        return rt.trim_rows(rows, keep)

    def settle(self, rows, accepted, provisional=None, *, pool=PoolKind.MAIN) -> int:
        """Speculative settlement: commit the accepted frontiers, then trim rejected trailing pages to
        ``max(accepted, provisional)`` (``provisional`` keeps mappings, e.g. for the next round's
        draft window).  ``rows``: execution rows with vectors, or one :class:`SequenceHandle` with
        integers.  Returns the pages freed."""
        rt, rows, accepted, keep = self.check_settle(rows, accepted, provisional, pool=pool)
        return rt.settle_rows(rows, accepted, keep)

    def truncate(self, handle: SequenceHandle, frontier: int, *, pool="main", provisional: int = 0) -> None:
        """Lower the committed frontier to ``frontier`` (not below the protected frontier), then trim.

        A sequence quarantined by a resync may be truncated to at most the intact frontier the resync
        reported for ``pool``; once no pool commits beyond its intact frontier the sequence returns
        to service (its block-table rows are published again)."""
        rec = self._core.sequence_record(handle)
        row = rec.row
        rt = self._core.runtime(pool)
        rows = np.array([row], np.int64)
        frontier = int(self._targets("frontier", rows, self._one("frontier", frontier))[0])
        provisional = int(self._targets("provisional", rows, self._one("provisional", provisional))[0])
        if rec.lost is None:
            self._core.handle_row(handle, "truncate")
        elif frontier > rec.lost[rt.kind]:
            raise self._core.lost_error(handle, rec, f"truncate of pool {rt.kind.value} to {frontier} (above its intact "
                                                f"frontier)")
        lo, hi = int(rt.spaces.protected[row]), int(rt.spaces.committed[row])
        if not lo <= frontier <= hi:
            raise LifecycleError(
                f"pool {rt.kind.value}: truncate frontier {frontier} is outside [{lo}, {hi}] (protected frontier, "
                f"committed frontier)"
            )
        rt.check_trim(rows, np.array([provisional], np.int64), committed=np.array([frontier], np.int64))
        rt.truncate_row(row, frontier, provisional)
        self._core.revive_if_intact(rec)

    def round_boundary(self, rows=None, *, step_tokens: int = 1) -> RoundGrant:
        """Grow ``kv_lease_growth`` entitlements at a decode-round boundary (vectorized).

        Each lane wants ``min(target, committed + window + cushion)`` Main tokens (plus each pool's
        lead), granted from available pages in row order.  A lane whose entitlement cannot cover its
        next ``step_tokens`` tokens is ``length_limited``: end it with finish reason ``length``.
        Lanes with a full entitlement never change.
        """
        main = self._core.main
        rows = self._core.rows.active() if rows is None else self._core.rows.check(rows)
        step = _int("step_tokens", step_tokens, 1)
        committed = main.spaces.committed[rows]
        target = main.spaces.target[rows]
        growth = main.spaces.growth[rows]
        desired = np.where(growth, self._core.policy.desired_tokens(committed, target), 0)
        cap = self._core.logical_pages * PAGE_SIZE
        granted = {}
        covered = target.copy()
        for kind, rt in self._core.runtimes.items():
            want = pages_for_tokens(np.minimum(cap, desired + rt.lead_tokens * (desired > 0)))
            granted[kind] = rt.grow(rows, want)
            pool_cover = rt.spaces.ent_pages[rows] * PAGE_SIZE - rt.lead_tokens
            covered = np.minimum(covered, pool_cover)
        limited = covered < np.minimum(target, committed + step)
        return RoundGrant(rows=rows, covered_tokens=covered, length_limited=limited, granted_pages=granted)

