"""Activation and finish: the verb family that leases rows and moves address spaces in and out of
execution, atomically over every enabled pool.

Activation runs these stages over every enabled pool, in order::

    claim_spaces -> reserve -> restore_host -> move_fork -> private_tail
                 -> lease_rows -> publish_tables -> publish_active

Any failure (including one raised by the test-only ``fault_injector``, called as
``fault_injector(stage, pool_kind_or_None)`` before each stage of each pool) undoes every completed
step in reverse, leaving the store — the source checkpoint and the pending round work included —
exactly as before.  ``restore_host`` stages the source's Host-only pages into the pending work
(the ``reserve`` stage reserved Device pages for them); ``private_tail`` records the partial-tail
COW copy there.

An activation from a checkpoint continues it from its whole committed frontier, or from a prefix of
it (``source_tokens``): each pool then carries the part of its content that the prefix determines
(:data:`PREFIX_LOOKAHEAD`), and only the source pages that part reads are restored from the Host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from ..schema.geometry import PAGE_SIZE
from ..schema.kinds import PoolKind
from .bundle import CheckpointHandle, SequenceHandle, _Record
from .entitlement import pages_for_tokens
from ..schema.errors import EntitlementError, IncompleteContinuationError, LifecycleError, PoolCapacityError
from .rows import as_index as _int
from .rows import as_integer
from .core import StoreCore

__all__ = ["ActivationVerbs", "ACTIVATION_STAGES", "PREFIX_LOOKAHEAD"]

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

PREFIX_LOOKAHEAD: Mapping[PoolKind, int] = {PoolKind.MTP: 1}
"""Tokens past position ``i`` that a pool's KV at ``i`` is computed from (absent: 0).  The MTP head's
KV at ``i`` reads the pair ``(h_i, t_{i+1})``, so a fork at a prefix of ``n`` tokens, which does not
share the checkpoint's token ``n``, carries at most ``n - 1`` MTP positions."""


@dataclasses.dataclass(frozen=True)
class PoolActivationPlan:
    """What an activation does in one pool, planned before anything changes.

    Attributes:
      kind: the pool.
      rt: its :class:`~ninfer_kv.store.runtime.PoolRuntime`.
      ent: entitlement pages of the new address space.
      reserve: pages reserved for it (entitlement beyond the carried pages, plus Host-only pages
        that must come back to the device).
      restore: Host-only pages of the source restored to the device.
      read_blocks: the source's first logical blocks the new sequence reads (carried pages and a
        partial tail's COW source); only Host-only pages among them are restored.
      src: the source checkpoint's space slot (``None``: the root).
      move: the source is moved (no copy; its partial tail continues in place).
      carried: pages carried from the source; ``carried_committed``: their committed tokens.
      tail: ``(source tail page slot, block, columns)`` of a partial tail to copy (COW), or ``None``.
    """

    kind: PoolKind
    rt: Any
    ent: int
    reserve: int
    restore: int
    read_blocks: int
    src: int | None
    move: bool
    carried: int
    carried_committed: int
    tail: tuple | None


class ActivationVerbs:
    """``activate``, ``finish`` and ``release_checkpoint`` of :class:`~ninfer_kv.store.KVStore`."""

    _core: StoreCore

    def activate(
        self,
        prompt_tokens: int,
        max_new_tokens: int = 0,
        *,
        source: CheckpointHandle | None = None,
        source_tokens: int | None = None,
        release_source: bool = False,
    ) -> SequenceHandle:
        """Activate a sequence from the root or from a retained checkpoint, atomically over every pool.

        Args:
          prompt_tokens: tokens of the prompt, including the prefix the checkpoint already holds.
          max_new_tokens: the output budget; the entitlement covers ``prompt + budget`` by default.
          source: a reusable checkpoint to continue from.
          source_tokens: continue from the first ``n`` tokens of ``source`` only (``None``: its whole
            Main frontier ``F``).  An integer in ``[1, F]`` (0 is the root: pass ``source=None``) and
            ``<= prompt_tokens``.  The new sequence's Main frontier is ``n``: the full pages below
            ``n`` are shared, a partial tail of ``n mod P`` columns is copied (COW) from the
            checkpoint's page holding token ``n - 1``, nothing beyond ``n`` is carried.  Every other
            pool continues from ``min(n - lookahead, its committed frontier)`` (``lookahead`` from
            :data:`PREFIX_LOOKAHEAD`: 1 for MTP, whose KV at ``i`` reads token ``i + 1``, 0 for Draft
            Full), never below 0, with the same sharing and COW rule.  ``n = F`` is exactly
            ``None``: every pool continues from its whole frontier (the checkpoint's own
            continuation).  Only the source's Host-only pages below each pool's continuation (the
            tail's COW source included) are restored; the others stay Host-only.  The checkpoint's
            state image stands for its whole frontier: from a prefix the caller resumes its model
            at the continued frontiers (``address_space(handle, pool).committed_frontier``).
          release_source: the caller gives the checkpoint up.  Pools that continue from the
            checkpoint's whole frontier and where nothing else references its partial tail *Move*
            its pages (no copy; the partial tail continues in place); otherwise the checkpoint is
            *Forked* — full pages shared immutably, a partial tail copied into a private page — and
            released afterwards (so a prefix ``n < F`` forks Main and releases the rest of the
            checkpoint).  Refused (:class:`LifecycleError`) while an in-flight copy pins a page of
            the checkpoint, as :meth:`release_checkpoint` is.  With ``False`` the checkpoint
            survives (Fork).

        Every argument is checked before anything changes: a refused activation leaves the store
        exactly as it was.

        Returns:
          The new :class:`SequenceHandle`; its row is ``store.row(handle)``.
        """
        prompt = _int("prompt_tokens", prompt_tokens)
        budget = _int("max_new_tokens", max_new_tokens)
        target = prompt + budget
        if target > self._core.max_context:
            raise EntitlementError(
                f"prompt_tokens + max_new_tokens = {target} exceeds max_context={self._core.max_context} "
                f"(allowed: 0..{self._core.max_context})"
            )
        src_rec = None
        prefix = None  # the Main prefix continued from (None: the whole checkpoint)
        if source is not None:
            src_rec = self._core.checkpoint_record(source, "activate")
            if not self._core.reusable(src_rec):
                raise IncompleteContinuationError(
                    "the checkpoint holds no state image and the model requires one: KV pages alone are not a "
                    "reusable continuation"
                )
            f_main = int(self._core.main.spaces.committed[src_rec.slots[PoolKind.MAIN]])
            if source_tokens is None:
                if prompt < f_main:
                    raise ValueError(f"prompt_tokens={prompt} is below the checkpoint frontier {f_main}")
            else:
                n = as_integer("source_tokens", source_tokens)
                if n == 0:
                    raise ValueError(
                        "source_tokens=0 continues nothing of the checkpoint: that is the root, pass source=None"
                    )
                if f_main == 0:
                    raise ValueError(
                        f"source_tokens={n}: the checkpoint holds no Main tokens (frontier 0); continue it with "
                        f"source_tokens=None"
                    )
                if not 1 <= n <= f_main:
                    raise ValueError(
                        f"source_tokens={n} is outside the checkpoint: allowed 1..{f_main} (its Main frontier)"
                    )
                if n > prompt:
                    raise ValueError(
                        f"source_tokens={n} exceeds prompt_tokens={prompt}: the continued prefix is part of the "
                        f"prompt (allowed: 1..{min(prompt, f_main)})"
                    )
                prefix = None if n == f_main else n
        else:
            if release_source:
                raise ValueError("release_source=True needs a source checkpoint")
            if source_tokens is not None:
                raise ValueError(f"source_tokens={source_tokens!r} needs a source checkpoint")
        if not self._core.rows.free:
            raise PoolCapacityError(f"all {self._core.max_concurrency} execution rows are leased")

        # -- plan every pool (no state changes) --------------------------------------------------------
        growth = self._core.policy.kv_lease_growth
        min_tok, want_tok = self._core.policy.activation_tokens(prompt, target)
        cap = self._core.logical_pages * PAGE_SIZE
        plans = []
        for kind, rt in self._core.runtimes.items():
            lo = pages_for_tokens(min(cap, min_tok + rt.lead_tokens))
            hi = pages_for_tokens(min(cap, want_tok + rt.lead_tokens))
            src_slot = tail_slot = None
            carried = full = partial = restore = read = c = 0
            move = False
            if src_rec is not None:
                src_slot = src_rec.slots[kind]
                whole = int(rt.spaces.committed[src_slot])
                c = whole if prefix is None else min(whole, max(0, prefix - PREFIX_LOOKAHEAD.get(kind, 0)))
                full, partial = divmod(c, PAGE_SIZE)
                if partial:
                    tail_slot = int(rt.spaces.membership[src_slot, full])
                move = release_source and c == whole and (not partial or int(rt.pages.refs[tail_slot]) == 1)
                carried = int(rt.spaces.n_blocks[src_slot]) if move else full
                read = pages_for_tokens(c)  # == the source's page count when the whole frontier continues
                src_pages = rt.spaces.pages_of(src_slot)
                restore = int((rt.pages.device_page[src_pages[:read]] < 0).sum())  # Host-only pages read
                if release_source and (rt.pages.pins[src_pages] != 0).any():
                    raise LifecycleError(
                        f"pool {kind.value}: the checkpoint's pages are pinned by an in-flight copy; it cannot be "
                        f"{'moved' if move else 'released'} now"
                    )
                lo = max(lo, pages_for_tokens(c))
                hi = max(hi, lo)
            ent = max(lo, min(hi, carried + rt.pool.available - restore)) if growth else hi
            plans.append(
                PoolActivationPlan(
                    kind=kind,
                    rt=rt,
                    ent=ent,
                    reserve=ent - carried + restore,
                    restore=restore,
                    read_blocks=read,
                    src=src_slot,
                    move=move,
                    carried=carried,
                    carried_committed=(c if move else full * PAGE_SIZE) if src_slot is not None else 0,
                    tail=(tail_slot, full, partial) if (partial and not move) else None,
                )
            )

        undo: list[Callable[[], None]] = []
        try:
            row = self._core.rows.take()
            undo.append(lambda: self._core.rows.untake(row))
            handle = self._core.registry.add(_Record("sequence", {p.kind: row for p in plans}, row=row))
            undo.append(lambda: self._core.registry.undo_add(handle))
            for p in plans:
                self._core.fault("claim_spaces", p.kind)
                undo.append(p.rt.claim(row, handle.id, p.ent, target, growth))
            for p in plans:
                self._core.fault("reserve", p.kind)
                undo.append(p.rt.reserve(row, p.reserve))
            for p in plans:
                self._core.fault("restore_host", p.kind)
                undo.append(self._restore_host_pages(p, row))
            for p in plans:
                self._core.fault("move_fork", p.kind)
                if p.src is not None:
                    undo.append(p.rt.carry(row, p.src, p.carried, p.carried_committed))
            for p in plans:
                self._core.fault("private_tail", p.kind)
                if p.tail is not None:
                    undo.append(p.rt.private_tail(row, *p.tail))
            self._core.fault("lease_rows", None)
            self._core.rows.lease(row, handle.id)
            undo.append(lambda: self._core.rows.unlease(row))
            for p in plans:
                self._core.fault("publish_tables", p.kind)
                undo.append(p.rt.publish_row(row))
            self._core.fault("publish_active", None)
        except BaseException:
            for action in reversed(undo):
                action()
            raise
        # -- commit: infallible --------------------------------------------------------------------------
        for p in plans:
            p.rt.commit_activation(row, p.src, p.move)
        if source is not None and release_source:
            for p in plans:
                if not p.move:
                    p.rt.release_inactive(p.src)
            self._core.registry.remove(source)
        return handle

    def _restore_host_pages(self, plan: PoolActivationPlan, row: int) -> Callable[[], None]:
        """Stage ``restore_host``: bring Host-only pages of the source back to Device replicas.

        The source's first ``plan.read_blocks`` pages are needed on Device (carried pages are read by
        the new sequence, a partial tail is the COW source; pages beyond a prefix continuation are
        not read and stay where they are), so each Host-only one gets a Device page materialized
        from the row's reservation (the ``reserve`` stage included them), its Host extent is copied
        in, epoch and coverage are verified, and the Device lease is published on the logical page
        (the Host replica stays: placement Both).  Returns the exact undo of that work.
        """
        if not plan.restore:
            return lambda: None
        return self._core.host.restore.for_activation(plan.kind, plan.src, row, blocks=plan.read_blocks)

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
        rec = self._core.sequence_record(handle, "finish(retain=True)" if retain else None)
        if retain:
            if self._core.requires_state_image and state_image is None:
                raise IncompleteContinuationError(
                    "retain needs the model's state image for this frontier (requires_state_image=True); "
                    "KV pages alone are not a reusable continuation"
                )
            if frontiers is not None:
                stated = {PoolKind.parse(k): v for k, v in frontiers.items()}
                if set(stated) != set(self._core.runtimes):
                    raise IncompleteContinuationError(
                        f"frontiers name pools {sorted(k.value for k in stated)}; every enabled pool "
                        f"{sorted(k.value for k in self._core.runtimes)} must be stated"
                    )
                for kind, f in stated.items():
                    c = int(self._core.runtimes[kind].spaces.committed[rec.row])
                    if f != c:
                        raise IncompleteContinuationError(
                            f"pool {kind.value}: checkpoint frontier {f} != committed frontier {c}; commit the "
                            f"pool to the checkpoint frontier before retaining"
                        )
        elif state_image is not None or frontiers is not None:
            raise ValueError("state_image and frontiers are only meaningful with retain=True")
        row = rec.row
        for rt in self._core.runtimes.values():
            rt.check_deactivate(row, retain)
        slots = {kind: rt.deactivate(row, retain) for kind, rt in self._core.runtimes.items()}
        self._core.registry.remove(handle)
        self._core.rows.release(row)
        if retain:
            return self._core.registry.add(_Record("checkpoint", slots, state_image=state_image))
        return None

    def release_checkpoint(self, handle: CheckpointHandle) -> None:
        """Release a retained checkpoint: drop its references; pages losing their last reference
        release their Device lease and their Host extent membership (an extent is freed with its last
        page).  Refused while a copy pins one of its pages."""
        rec = self._core.checkpoint_record(handle)
        for kind, rt in self._core.runtimes.items():
            pinned = np.flatnonzero(rt.pages.pins[rt.spaces.pages_of(rec.slots[kind])] != 0)
            if pinned.size:
                raise LifecycleError(
                    f"pool {kind.value}: cannot release the checkpoint: logical blocks {pinned.tolist()} are pinned "
                    f"by an in-flight copy"
                )
        for kind, rt in self._core.runtimes.items():
            rt.release_inactive(rec.slots[kind])
        self._core.registry.remove(handle)

