"""KVStore: the program-level facade over every growing pool.

The store owns, per enabled pool (one per :class:`~ninfer_kv.planning.PoolKind` of the plan), a
:class:`DevicePagePool`, the logical page descriptors, the address spaces, an ``int32 (C, L)``
block-table matrix and the device planes.  It decides Move / Fork / COW from the real references
and keeps every transition atomic across pools.

Life of a sequence::

    h = store.activate(prompt_tokens, max_new_tokens, source=ckpt_or_None, release_source=False)
    store.ensure_mapped_to_tokens(h, n)          # before a unit that writes up to n tokens
    tables = store.publish()                     # one batched table publication per round
    ... run the step on store.planes(kind) / tables, hand back the planes with set_planes ...
    store.commit(h, frontier)                    # only after the unit succeeded
    store.settle(h, accepted, provisional=...)   # speculative: commit accepted, trim rejected tails
    ckpt = store.finish(h, retain=True, state_image=token)   # or retain=False
    store.release_checkpoint(ckpt)

Decode rounds use the vectorized row verbs (``map_rows``, ``commit_rows``, ``settle_rows``,
``round_boundary``): numpy arrays of execution rows and frontiers in, no Python loop per lane.

Activation runs these stages over every enabled pool, in order::

    claim_spaces -> reserve -> restore_host -> move_fork -> private_tail
                 -> lease_rows -> publish_tables -> publish_active

Any failure (including one raised by the test-only ``fault_injector``, called as
``fault_injector(stage, pool_kind_or_None)`` before each stage of each pool) undoes every completed
step in reverse, leaving the store — the source checkpoint included — exactly as before.
``restore_host`` brings the source's Host-only pages back to Device (the ``reserve`` stage reserved
pages for them); a later failure undoes it like every other stage.

Host tier (``KVStore(..., host_arena=arena)`` or ``host_bytes=n``): one arena shared by every pool.
``offload_checkpoint`` (Device -> Host, placement ``device`` -> ``both``), ``drop_device_replica``
(``both`` -> ``host``), ``restore_checkpoint`` (``host`` -> ``both``), ``release_host_replica``
(``both`` -> ``device``); activation from a checkpoint with Host-only pages restores them.  See
:mod:`ninfer_kv.store.host_replicas` for the publication protocol and the rules.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from ..geometry import PAGE_SIZE
from ..planning import KVPlan, KVPoolSetLayout, PoolKind, SpeculativeBackend
from .address_space import KVAddressSpace
from .bundle import (
    CheckpointHandle,
    CheckpointInfo,
    HandleRegistry,
    SequenceHandle,
    SequenceKVBundle,
    _Record,
    next_store_serial,
)
from .entitlement import EntitlementPolicy, RoundGrant, pages_for_tokens
from .errors import (
    EntitlementError,
    IncompleteContinuationError,
    LifecycleError,
    PoolCapacityError,
)
from .host_replicas import HostTier, HostTransferReport, placement_of
from .rows import ExecutionRows, as_index, as_index_vector
from .runtime import PoolRuntime
from .summary import HostOccupancy, HostTransferStats, PoolOccupancy, StoreMemorySummary

__all__ = ["KVStore", "ACTIVATION_STAGES", "FaultInjector"]

ACTIVATION_STAGES: tuple[str, ...] = (
    "claim_spaces",
    "reserve",
    "restore_host",
    "move_fork",
    "private_tail",
    "lease_rows",
    "publish_tables",
    "publish_active",
)
"""Activation stages in order; ``lease_rows`` and ``publish_active`` are store-wide (pool ``None``)."""

FaultInjector = Callable[[str, "PoolKind | None"], None]


_int = as_index
_vec = as_index_vector


def _same_length(rows: np.ndarray, **others: np.ndarray) -> None:
    for name, arr in others.items():
        if arr.shape != rows.shape:
            raise ValueError(f"rows {rows.shape} and {name} {arr.shape} must be 1-D of one length")


class KVStore:
    """Device-tier KV store over the pools of a plan.

    Args:
      plan: a :class:`KVPlan` (from ``plan_kv_cache``) or a :class:`KVPoolSetLayout` with ``m``.
      m: Main page groups when ``plan`` is a :class:`KVPoolSetLayout`.
      entitlement: the :class:`EntitlementPolicy` (default: full prompt + output budget).
      requires_state_image: the model needs a state image to resume from a frontier (e.g. it has
        recurrent state).  Then ``finish(retain=True)`` must be given one; KV alone is not a hit.
      planes: optional pre-allocated planes per pool (default: ``layout.allocate(physical_pages)``).
      device: optional device for planes and block tables.
      fault_injector: test hook ``f(stage, pool)`` called before each activation stage and each
        Host transfer stage (``OFFLOAD_STAGES``, ``RESTORE_STAGES``).
      host_arena: a :class:`~ninfer_kv.host.HostKVArena` for the Host replica tier (shared by every
        pool; it must be empty: the store allocates and frees every extent in it).
      host_bytes: alternatively, the capacity of a new arena for ``device``.  Neither: no Host tier.
    """

    def __init__(
        self,
        plan: "KVPlan | KVPoolSetLayout",
        m: int | None = None,
        *,
        entitlement: EntitlementPolicy | None = None,
        requires_state_image: bool = False,
        planes: Mapping[PoolKind, Mapping[str, jax.Array]] | None = None,
        device=None,
        fault_injector: FaultInjector | None = None,
        host_arena=None,
        host_bytes: int | None = None,
    ):
        if isinstance(plan, KVPlan):
            if m is not None and m != plan.m:
                raise ValueError(f"m={m} disagrees with the plan's M={plan.m}")
            builder, pools = plan.builder, plan.pools
        elif isinstance(plan, KVPoolSetLayout):
            if m is None:
                raise ValueError("a KVPoolSetLayout needs m (Main page groups)")
            builder, pools = plan, plan.pools(m)
        else:
            raise TypeError(f"plan must be a KVPlan or KVPoolSetLayout, got {type(plan).__name__}")
        self.builder = builder
        self.max_context = builder.max_context
        self.max_concurrency = builder.max_concurrency
        self.logical_pages = builder.logical_pages
        self.page_size = PAGE_SIZE
        self.policy = entitlement or EntitlementPolicy()
        self.requires_state_image = bool(requires_state_image)
        self.fault_injector = fault_injector
        spec = builder.speculative
        self._rt: dict[PoolKind, PoolRuntime] = {}
        for kind, pool_plan in pools.items():
            lead = spec.draft_window - 1 if kind is PoolKind.MTP and spec.backend is SpeculativeBackend.MTP else 0
            if planes is not None and kind in planes:
                pool_planes = self._checked_planes(pool_plan, planes[kind])
            else:
                pool_planes = pool_plan.layout.allocate(pool_plan.physical_pages, device=device)
            self._rt[kind] = PoolRuntime(pool_plan, planes=pool_planes, lead_tokens=lead, device=device)
        self._main = self._rt[PoolKind.MAIN]
        self._rows = ExecutionRows(self.max_concurrency)
        self._registry = HandleRegistry(next_store_serial())
        self._host: HostTier | None = None
        arena = self._make_arena(host_arena, host_bytes, device)
        if arena is not None:
            self._host = HostTier(arena, self._rt, self._fault)
        # Host transfer counters (offloaded_pages, restored_pages, ...; zeros without a Host tier)
        self.stats: HostTransferStats = self._host.stats if self._host is not None else HostTransferStats()

    @staticmethod
    def _make_arena(host_arena, host_bytes, device):
        if host_arena is not None and host_bytes is not None:
            raise ValueError("pass either host_arena or host_bytes, not both")
        if host_bytes is not None:
            if not isinstance(host_bytes, (int, np.integer)) or isinstance(host_bytes, bool) or host_bytes < 1:
                raise ValueError(f"host_bytes={host_bytes!r} is invalid; it must be an integer >= 1")
            from ..host import HostKVArena

            return HostKVArena(int(host_bytes), device=device)
        return host_arena

    @staticmethod
    def _checked_planes(pool_plan, planes) -> dict[str, jax.Array]:
        layout = pool_plan.layout
        expected = layout.plane_shapes(pool_plan.physical_pages)
        if set(planes) != set(expected):
            raise ValueError(f"pool {pool_plan.kind.value}: planes {sorted(planes)} != {sorted(expected)}")
        for name, arr in planes.items():
            if tuple(arr.shape) != expected[name] or np.dtype(arr.dtype) != layout.plane(name).dtype:
                raise ValueError(
                    f"pool {pool_plan.kind.value}: plane {name!r} is {tuple(arr.shape)} {arr.dtype}, needs "
                    f"{expected[name]} {layout.plane(name).dtype}"
                )
        return dict(planes)

    # -- pools -------------------------------------------------------------------------------------------
    @property
    def pool_kinds(self) -> tuple[PoolKind, ...]:
        return tuple(self._rt)

    def _runtime(self, pool) -> PoolRuntime:
        kind = PoolKind.parse(pool)
        try:
            return self._rt[kind]
        except KeyError:
            raise ValueError(f"pool {kind.value} is not enabled; enabled pools: {[k.value for k in self._rt]}") from None

    def pool(self, kind="main"):
        """The :class:`DevicePagePool` of ``kind``."""
        return self._runtime(kind).pool

    def layout(self, kind="main"):
        return self._runtime(kind).layout

    def planes(self, kind="main") -> dict[str, jax.Array]:
        """The current device planes of ``kind`` (replaced by every COW copy: re-read before a step)."""
        return dict(self._runtime(kind).planes)

    def set_planes(self, kind, planes: Mapping[str, jax.Array]) -> None:
        """Hand back the planes a step returned (donated planes are replaced by the step's outputs)."""
        rt = self._runtime(kind)
        current = rt.planes
        if set(planes) != set(current):
            raise ValueError(f"pool {rt.kind.value}: planes {sorted(planes)} != {sorted(current)}")
        for name, arr in planes.items():
            old = current[name]
            if tuple(arr.shape) != tuple(old.shape) or arr.dtype != old.dtype:
                raise ValueError(
                    f"pool {rt.kind.value}: plane {name!r} is {tuple(arr.shape)} {arr.dtype}, needs "
                    f"{tuple(old.shape)} {old.dtype}"
                )
        rt.planes = dict(planes)

    # -- handles ---------------------------------------------------------------------------------------------
    def _sequence(self, handle) -> _Record:
        if not isinstance(handle, SequenceHandle):
            raise TypeError(f"expected a SequenceHandle, got {type(handle).__name__}")
        return self._registry.get(handle)

    def _checkpoint(self, handle) -> _Record:
        if not isinstance(handle, CheckpointHandle):
            raise TypeError(f"expected a CheckpointHandle, got {type(handle).__name__}")
        return self._registry.get(handle)

    def _handle_row(self, handle) -> np.ndarray:
        """The one-row vector of a sequence handle, through the row verbs' validation."""
        return self._rows.check_one(self._sequence(handle).row)

    def row(self, handle: SequenceHandle) -> int:
        """The execution row (block-table row in every pool) of an active sequence."""
        return self._sequence(handle).row

    def bundle(self, handle: SequenceHandle) -> SequenceKVBundle:
        rec = self._sequence(handle)
        spaces = {k: KVAddressSpace(rt, rec.row, int(rt.spaces.generation[rec.row])) for k, rt in self._rt.items()}
        return SequenceKVBundle(handle, rec.row, spaces)

    def address_space(self, handle, pool="main") -> KVAddressSpace:
        """The address space of a sequence or checkpoint in ``pool``."""
        rec = self._registry.get(handle)
        rt = self._runtime(pool)
        slot = rec.slots[rt.kind]
        return KVAddressSpace(rt, slot, int(rt.spaces.generation[slot]))

    def checkpoint(self, handle: CheckpointHandle) -> CheckpointInfo:
        rec = self._checkpoint(handle)
        frontiers = {k: int(rt.spaces.committed[rec.slots[k]]) for k, rt in self._rt.items()}
        spaces = {
            k: KVAddressSpace(rt, rec.slots[k], int(rt.spaces.generation[rec.slots[k]])) for k, rt in self._rt.items()
        }
        placement, counts = self._placement(rec)
        return CheckpointInfo(handle, frontiers, rec.state_image, self._reusable(rec), spaces, placement, counts)

    def _placement(self, rec: _Record) -> tuple[str, dict]:
        if self._host is not None:
            return self._host.placement(rec.slots)
        n = sum(int(self._rt[k].spaces.n_blocks[s]) for k, s in rec.slots.items())
        return placement_of(np.ones(n, bool), np.zeros(n, bool))

    def _reusable(self, rec: _Record) -> bool:
        return set(rec.slots) == set(self._rt) and (rec.state_image is not None or not self.requires_state_image)

    def sequences(self) -> list[SequenceHandle]:
        return self._registry.handles("sequence")

    def checkpoints(self) -> list[CheckpointHandle]:
        return self._registry.handles("checkpoint")

    def active_rows(self) -> np.ndarray:
        return self._rows.active()

    # -- activation ------------------------------------------------------------------------------------------
    def _fault(self, stage: str, kind: PoolKind | None) -> None:
        if self.fault_injector is not None:
            self.fault_injector(stage, kind)

    def activate(
        self,
        prompt_tokens: int,
        max_new_tokens: int = 0,
        *,
        source: CheckpointHandle | None = None,
        release_source: bool = False,
    ) -> SequenceHandle:
        """Activate a sequence from the root or from a retained checkpoint, atomically over every pool.

        Args:
          prompt_tokens: tokens of the prompt, including the prefix the checkpoint already holds.
          max_new_tokens: the output budget; the entitlement covers ``prompt + budget`` by default.
          source: a reusable checkpoint to continue from (its frontier must be <= ``prompt_tokens``).
          release_source: the caller gives the checkpoint up.  Pools where nothing else references
            its pages *Move* them (no copy; the partial tail continues in place); otherwise the
            checkpoint is *Forked* — full pages shared immutably, a partial tail copied into a
            private page — and released afterwards.  With ``False`` the checkpoint survives (Fork).

        Returns:
          The new :class:`SequenceHandle`; its row is ``store.row(handle)``.
        """
        prompt = _int("prompt_tokens", prompt_tokens)
        budget = _int("max_new_tokens", max_new_tokens)
        target = prompt + budget
        if target > self.max_context:
            raise EntitlementError(
                f"prompt_tokens + max_new_tokens = {target} exceeds max_context={self.max_context} "
                f"(allowed: 0..{self.max_context})"
            )
        src_rec = None
        if source is not None:
            src_rec = self._checkpoint(source)
            if not self._reusable(src_rec):
                raise IncompleteContinuationError(
                    "the checkpoint holds no state image and the model requires one: KV pages alone are not a "
                    "reusable continuation"
                )
            f_main = int(self._main.spaces.committed[src_rec.slots[PoolKind.MAIN]])
            if prompt < f_main:
                raise ValueError(f"prompt_tokens={prompt} is below the checkpoint frontier {f_main}")
        elif release_source:
            raise ValueError("release_source=True needs a source checkpoint")
        if not self._rows.free:
            raise PoolCapacityError(f"all {self.max_concurrency} execution rows are leased")

        # -- plan every pool (no state changes) --------------------------------------------------------
        growth = self.policy.kv_lease_growth
        min_tok, want_tok = self.policy.activation_tokens(prompt, target)
        cap = self.logical_pages * PAGE_SIZE
        plans = []
        for kind, rt in self._rt.items():
            lo = pages_for_tokens(min(cap, min_tok + rt.lead_tokens))
            hi = pages_for_tokens(min(cap, want_tok + rt.lead_tokens))
            src_slot = tail_slot = None
            carried = full = partial = restore = 0
            move = False
            if src_rec is not None:
                src_slot = src_rec.slots[kind]
                c = int(rt.spaces.committed[src_slot])
                full, partial = divmod(c, PAGE_SIZE)
                if partial:
                    tail_slot = int(rt.spaces.membership[src_slot, full])
                move = release_source and (not partial or int(rt.pages.refs[tail_slot]) == 1)
                carried = int(rt.spaces.n_blocks[src_slot]) if move else full
                src_pages = rt.spaces.pages_of(src_slot)
                restore = int((rt.pages.device_page[src_pages] < 0).sum())  # Host-only pages
                if move and (rt.pages.pins[src_pages] != 0).any():
                    raise LifecycleError(
                        f"pool {kind.value}: the checkpoint's pages are pinned by an in-flight copy; it cannot be "
                        f"moved now"
                    )
                lo = max(lo, pages_for_tokens(c))
                hi = max(hi, lo)
            ent = max(lo, min(hi, carried + rt.pool.available - restore)) if growth else hi
            plans.append(
                dict(
                    kind=kind,
                    rt=rt,
                    ent=ent,
                    reserve=ent - carried + restore,
                    restore=restore,
                    src=src_slot,
                    move=move,
                    carried=carried,
                    carried_committed=(int(rt.spaces.committed[src_slot]) if move else full * PAGE_SIZE)
                    if src_slot is not None
                    else 0,
                    tail=(tail_slot, full, partial) if (partial and not move) else None,
                )
            )

        undo: list[Callable[[], None]] = []
        try:
            row = self._rows.take()
            undo.append(lambda: self._rows.untake(row))
            handle = self._registry.add(_Record("sequence", {p["kind"]: row for p in plans}, row=row))
            undo.append(lambda: self._registry.undo_add(handle))
            for p in plans:
                self._fault("claim_spaces", p["kind"])
                undo.append(p["rt"].claim(row, handle.id, p["ent"], target, growth))
            for p in plans:
                self._fault("reserve", p["kind"])
                undo.append(p["rt"].reserve(row, p["reserve"]))
            for p in plans:
                self._fault("restore_host", p["kind"])
                undo.append(self._restore_host_pages(p, row))
            for p in plans:
                self._fault("move_fork", p["kind"])
                if p["src"] is not None:
                    undo.append(p["rt"].carry(row, p["src"], p["carried"], p["carried_committed"]))
            for p in plans:
                self._fault("private_tail", p["kind"])
                if p["tail"] is not None:
                    undo.append(p["rt"].private_tail(row, *p["tail"]))
            self._fault("lease_rows", None)
            self._rows.lease(row, handle.id)
            undo.append(lambda: self._rows.unlease(row))
            for p in plans:
                self._fault("publish_tables", p["kind"])
                undo.append(p["rt"].publish_row(row))
            self._fault("publish_active", None)
        except BaseException:
            for action in reversed(undo):
                action()
            raise
        # -- commit: infallible --------------------------------------------------------------------------
        for p in plans:
            p["rt"].commit_activation(row, p["src"] if p["move"] else None)
        if source is not None and release_source:
            for p in plans:
                if not p["move"]:
                    p["rt"].release_inactive(p["src"])
            self._registry.remove(source)
        return handle

    def _restore_host_pages(self, plan: dict, row: int) -> Callable[[], None]:
        """Stage ``restore_host``: bring Host-only pages of the source back to Device replicas.

        Every page of the source is needed on Device (carried pages are read by the new sequence, a
        partial tail is the COW source), so each Host-only page gets a Device page materialized from
        the row's reservation (the ``reserve`` stage included them), its Host extent is copied in,
        epoch and coverage are verified, and the Device lease is published on the logical page (the
        Host replica stays: placement Both).  Returns the exact undo of that work.
        """
        if not plan["restore"]:
            return lambda: None
        return self._host.restore_for_activation(plan["kind"], plan["src"], row)

    # -- mapping, commit, trim ---------------------------------------------------------------------------------
    def ensure_mapped_to_tokens(self, handle: SequenceHandle, tokens: int, *, pool="main") -> int:
        """Make the sequence's membership in ``pool`` cover ``tokens`` tokens (a lower bound).

        A no-op when the membership already covers ``tokens`` (even if it covers more).  Fails, with
        nothing changed, only when ``tokens`` exceeds the entitlement.  Never advances a frontier,
        never trims, never changes the entitlement.  Returns the number of pages materialized.
        """
        rows = self._handle_row(handle)
        tokens = _int("tokens", tokens)
        return self._runtime(pool).map_rows(rows, np.array([tokens], np.int64))

    def commit(self, handle: SequenceHandle, frontier: int, *, pool="main") -> None:
        """Advance the committed frontier after a unit succeeded (within the mapped extent)."""
        rows = self._handle_row(handle)
        frontier = _int("frontier", frontier)
        self._runtime(pool).commit_rows(rows, np.array([frontier], np.int64))

    def trim(self, handle: SequenceHandle, *, pool="main", provisional: int = 0) -> int:
        """Keep ``ceil(max(committed, provisional) / P)`` pages; leases return to the reservation."""
        rows = self._handle_row(handle)
        provisional = _int("provisional", provisional)
        return self._runtime(pool).trim_rows(rows, np.array([provisional], np.int64))

    def truncate(self, handle: SequenceHandle, frontier: int, *, pool="main", provisional: int = 0) -> None:
        """Lower the committed frontier to ``frontier`` (not below the protected frontier), then trim."""
        row = int(self._handle_row(handle)[0])
        rt = self._runtime(pool)
        frontier = _int("frontier", frontier)
        provisional = _int("provisional", provisional)
        lo, hi = int(rt.spaces.protected[row]), int(rt.spaces.committed[row])
        if not lo <= frontier <= hi:
            raise LifecycleError(
                f"pool {rt.kind.value}: truncate frontier {frontier} is outside [{lo}, {hi}] (protected frontier, "
                f"committed frontier)"
            )
        rt.truncate_row(row, frontier, provisional)

    def settle(self, handle: SequenceHandle, accepted_frontier: int, *, pool="main", provisional: int | None = None):
        """Speculative settlement: commit the accepted frontier, then trim rejected trailing pages.

        ``provisional`` keeps mappings up to that many tokens (e.g. the next round's draft window).
        """
        rows = self._handle_row(handle)
        accepted_frontier = _int("accepted_frontier", accepted_frontier)
        keep = accepted_frontier if provisional is None else _int("provisional", provisional)
        self._settle(self._runtime(pool), rows, np.array([accepted_frontier], np.int64), np.array([keep], np.int64))

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
        return self._settle(rt, rows, accepted, keep)

    @staticmethod
    def _settle(rt: PoolRuntime, rows: np.ndarray, accepted: np.ndarray, keep: np.ndarray) -> int:
        saved = rt.spaces.committed[rows]
        rt.commit_rows(rows, accepted)
        try:
            return rt.trim_rows(rows, keep)
        except BaseException:  # a refused trim (pinned pages) leaves the frontiers as they were
            rt.spaces.committed[rows] = saved
            raise

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

    # -- finish and release ----------------------------------------------------------------------------------------
    def finish(
        self,
        handle: SequenceHandle,
        *,
        retain: bool = False,
        state_image: Any = None,
        frontiers: Mapping | None = None,
    ) -> CheckpointHandle | None:
        """End an active sequence: release its row, writer and unmaterialized entitlement.

        With ``retain=False`` every membership is released.  With ``retain=True`` the address spaces
        become one immutable inactive checkpoint holding ``ceil(committed / P)`` pages per pool (the
        provisional lead is trimmed: it is never checkpoint coverage) and ``state_image``, the model's
        opaque state token for the same frontier.  A complete continuation is required: when the
        store ``requires_state_image`` a state image must be given, and ``frontiers`` (optional,
        ``{pool: tokens}`` for every enabled pool) must equal each pool's committed frontier.

        Returns the :class:`CheckpointHandle`, or ``None`` when released.
        """
        rec = self._sequence(handle)
        if retain:
            if self.requires_state_image and state_image is None:
                raise IncompleteContinuationError(
                    "retain needs the model's state image for this frontier (requires_state_image=True); "
                    "KV pages alone are not a reusable continuation"
                )
            if frontiers is not None:
                stated = {PoolKind.parse(k): v for k, v in frontiers.items()}
                if set(stated) != set(self._rt):
                    raise IncompleteContinuationError(
                        f"frontiers name pools {sorted(k.value for k in stated)}; every enabled pool "
                        f"{sorted(k.value for k in self._rt)} must be stated"
                    )
                for kind, f in stated.items():
                    c = int(self._rt[kind].spaces.committed[rec.row])
                    if f != c:
                        raise IncompleteContinuationError(
                            f"pool {kind.value}: checkpoint frontier {f} != committed frontier {c}; commit the "
                            f"pool to the checkpoint frontier before retaining"
                        )
        elif state_image is not None or frontiers is not None:
            raise ValueError("state_image and frontiers are only meaningful with retain=True")
        row = rec.row
        for rt in self._rt.values():
            rt.check_deactivate(row, retain)
        slots = {kind: rt.deactivate(row, retain) for kind, rt in self._rt.items()}
        self._registry.remove(handle)
        self._rows.release(row)
        if retain:
            return self._registry.add(_Record("checkpoint", slots, state_image=state_image))
        return None

    def release_checkpoint(self, handle: CheckpointHandle) -> None:
        """Release a retained checkpoint: drop its references; pages losing their last reference
        release their Device lease and their Host extent membership (an extent is freed with its last
        page).  Refused while a copy pins one of its pages."""
        rec = self._checkpoint(handle)
        for kind, rt in self._rt.items():
            pinned = np.flatnonzero(rt.pages.pins[rt.spaces.pages_of(rec.slots[kind])] != 0)
            if pinned.size:
                raise LifecycleError(
                    f"pool {kind.value}: cannot release the checkpoint: logical blocks {pinned.tolist()} are pinned "
                    f"by an in-flight copy"
                )
        for kind, rt in self._rt.items():
            rt.release_inactive(rec.slots[kind])
        self._registry.remove(handle)

    # -- Host tier -------------------------------------------------------------------------------------------------
    def _tier(self, verb: str) -> HostTier:
        if self._host is None:
            raise LifecycleError(f"{verb} needs a Host tier; build the store with host_arena= or host_bytes=")
        return self._host

    @property
    def host_arena(self):
        """The :class:`~ninfer_kv.host.HostKVArena` of the Host tier, or ``None``."""
        return None if self._host is None else self._host.arena

    def offload_checkpoint(self, handle: CheckpointHandle) -> HostTransferReport:
        """Device -> Host copy of every page of a retained checkpoint, in every pool, that has no valid
        Host replica yet (placement ``device`` -> ``both``).

        Per pool: reserve one destination extent (the whole recipe of every pool is proven by
        ``arena.validate_plan`` first) -> copy (pages pinned) -> verify epoch and committed coverage
        -> publish the Host replicas.  The Device replicas stay (see :meth:`drop_device_replica`).
        Adjacent physical IDs are copied as one run.

        Raises :class:`HostCapacityError` (a :class:`PoolCapacityError`) when the arena cannot place
        the extents, :class:`StaleReplicaError` when a page changed during the copy, and
        :class:`LifecycleError` when a page is pinned by another copy; the store is then unchanged.
        Returns a :class:`HostTransferReport` (pages, bytes, runs, chunks, per pool).
        """
        rec = self._checkpoint(handle)
        return self._tier("offload_checkpoint").offload(rec.slots)

    def drop_device_replica(self, handle: CheckpointHandle) -> int:
        """Release the Device leases of a checkpoint whose pages all have a valid Host replica
        (placement ``both`` -> ``host``); returns the leases released.

        Rule: a page read by an active address space stays on Device; a page shared only among
        inactive checkpoints may become Host-only (a later activation of any of them restores it).
        Refused (:class:`LifecycleError`, nothing changed) when a page with a Device replica has no
        valid Host replica, is pinned, or is referenced by an active address space.
        """
        rec = self._checkpoint(handle)
        return self._tier("drop_device_replica").drop_device(rec.slots)

    def restore_checkpoint(self, handle: CheckpointHandle, *, drop_host: bool = False) -> HostTransferReport:
        """Host -> Device copy of the checkpoint's Host-only pages (placement ``host`` -> ``both``).

        Per pool: reserve Device pages from the available pages -> copy -> verify -> publish the Device
        leases.  The Host replicas stay unless ``drop_host=True`` (then every Host replica of the
        checkpoint is released afterwards: placement ``device``).  Raises
        :class:`PoolCapacityError` (nothing changed) when a pool lacks available pages.
        """
        rec = self._checkpoint(handle)
        return self._tier("restore_checkpoint").restore(rec.slots, drop_host=bool(drop_host))

    def release_host_replica(self, handle: CheckpointHandle) -> int:
        """Release the Host replicas of a checkpoint's pages (placement ``both`` -> ``device``); an
        extent is freed with its last page.  Refused (nothing changed) when a page is Host-only (its
        Host replica is its only copy) or pinned.  Returns the replicas released."""
        rec = self._checkpoint(handle)
        return self._tier("release_host_replica").release_host(rec.slots)

    def host_occupancy(self) -> HostOccupancy | None:
        """The Host arena's occupancy, per-pool Host pages and the transfer counters (``None`` without
        a Host tier)."""
        return None if self._host is None else self._host.occupancy()

    def host_counters(self) -> dict:
        """The Host transfer counters as a dict (``offloaded_pages``, ``restored_pages``, ...)."""
        return self.stats.to_json()

    # -- block tables ------------------------------------------------------------------------------------------------
    def publish(self) -> dict[PoolKind, jax.Array]:
        """Publish every pending block-table update (one donated scatter per pool); returns the tables."""
        return {kind: rt.table.publish() for kind, rt in self._rt.items()}

    @property
    def block_tables(self) -> dict[PoolKind, jax.Array]:
        """The device block tables as of the last :meth:`publish`."""
        return {kind: rt.table.device for kind, rt in self._rt.items()}

    def host_block_table(self, kind="main") -> np.ndarray:
        """A copy of the host mirror (includes updates not yet published)."""
        return self._runtime(kind).table.host.copy()

    # -- summaries and checks ------------------------------------------------------------------------------------------
    def occupancy(self, kind="main") -> PoolOccupancy:
        rt = self._runtime(kind)
        pg, sp = rt.pages, rt.spaces
        live = pg.live
        inactive = sp.live & ~sp.active
        return PoolOccupancy(
            pool=rt.kind.value,
            capacity=rt.pool.capacity,
            allocated=rt.pool.allocated,
            reserved=rt.pool.reserved,
            available=rt.pool.available,
            logical_pages=int(live.sum()),
            shared_pages=int((live & (pg.refs > 1)).sum()),
            mapped_blocks=int(sp.n_blocks[sp.live].sum()),
            active_spaces=int(sp.active.sum()),
            retained_checkpoints=int(inactive.sum()),
            page_bytes=rt.layout.page_bytes,
            plane_bytes=rt.layout.buffer_bytes(rt.pool.capacity),
            table_bytes=rt.rows * rt.logical_pages * 4,
            host_pages=int((live & (pg.host_page >= 0)).sum()),
            host_only_pages=int((live & (pg.device_page < 0)).sum()),
        )

    def memory_summary(self) -> StoreMemorySummary:
        return StoreMemorySummary(
            pools={k.value: self.occupancy(k) for k in self._rt},
            active_sequences=int(self._rows.active().size),
            retained_checkpoints=len(self.checkpoints()),
            host=self.host_occupancy(),
            offloaded_pages=self.stats.offloaded_pages,
            restored_pages=self.stats.restored_pages,
        )

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` on any inconsistency (every pool, rows and handles)."""
        from .errors import InvariantError

        for rt in self._rt.values():
            rt.check_invariants()
        active = self._rows.active()
        for kind, rt in self._rt.items():
            if not np.array_equal(np.flatnonzero(rt.spaces.active[: self.max_concurrency]), active):
                raise InvariantError(f"pool {kind.value}: active rows disagree with leased rows")
        self._rows.check_invariants(InvariantError)
        for h in self.sequences():
            if self._rows.owner[self._registry.get(h).row] != h.id:
                raise InvariantError(f"sequence {h.id} does not own its row")
        if self._host is not None:
            self._host.check_invariants()

    def snapshot(self) -> dict:
        """A comparable deep copy of every piece of semantic state (for tests and debugging)."""
        return {
            "pools": {k.value: rt.snapshot() for k, rt in self._rt.items()},
            "rows": self._rows.snapshot(),
            "registry": self._registry.snapshot(),
            "host": None if self._host is None else self._host.snapshot(),
            "stats": self.stats.to_json(),
        }

    def __repr__(self) -> str:
        pools = ", ".join(f"{k.value}:{rt.pool.capacity}" for k, rt in self._rt.items())
        host = "" if self._host is None else f", host_arena={self._host.arena.capacity}"
        return (
            f"KVStore(S={self.max_context}, C={self.max_concurrency}, L={self.logical_pages}, pools=[{pools}], "
            f"active={int(self._rows.active().size)}, checkpoints={len(self.checkpoints())}{host})"
        )
