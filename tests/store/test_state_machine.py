"""Stateful property test of the KV store against an independent model.

Random sequences of activate (root / Fork / Move, from a checkpoint's whole frontier or a prefix of
it) / map / unit (write through the device block table + speculative settle) / failed unit /
truncate / decode round / round boundary / finish-retain /
finish-release / release-checkpoint / offload / drop Device replica / restore / release Host replica /
a caller's slip repaired by resync run on tiny ordinary, MTP and DFlash pool sets (with real, tiny device planes and a small Host arena
that runs out now and then).  After every step the test checks, from outside the store:

* the capacity identity per pool, and that allocated pages are exactly the distinct pages mapped;
* every active reservation equals entitlement - mapped pages (so mapping never fails inside it);
* content of every sequence and checkpoint, every pool, every plane and layer, equals the model's
  committed tokens — read from the Device replica, or from the Host arena for Host-only pages (so
  shared pages and protected columns were never overwritten, COW copies, offloads and restores are
  exact, and a unit that wrote without committing changed nothing visible);
* a checkpoint's placement follows the verbs (offload -> every page has a valid Host replica, drop
  -> none on Device, restore -> all on Device, an activation -> the pages it reads on Device, the
  others as they were); refused verbs change nothing;
* each shared full page keeps its bytes while shared; at most one writer per page;
* rows are held only by active sequences; published device block-table rows mirror memberships and
  idle rows hold the sentinel;
* at the end, after finishing and releasing everything, every page is free, every descriptor
  reclaimed and the Host arena is one free extent.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.device import apply_work_jit, gather_pages, resync
from ninfer_kv.store.activation import PREFIX_LOOKAHEAD
from ninfer_kv.store import EntitlementPolicy, KVStore
from ninfer_kv.schema.geometry import SENTINEL_PAGE
from ninfer_kv.schema.errors import (
    EntitlementError,
    HostCapacityError,
    LifecycleError,
    LostContentError,
    PayloadError,
    TargetError,
    PoolCapacityError,
    RowError,
    StaleHandleError,
)

from .helpers import (P, assert_same, content_ok, device, page_bytes, planes_of, space_content_ok, sync, tiny_plan,
                      write_positions, write_tokens)
from ninfer_kv.device import allocate_state, gather_offload, offload_checkpoint

MAIN = PoolKind.MAIN


class _Seq:
    def __init__(self, target, content):
        self.target = target
        self.content = content  # PoolKind -> list of committed token values


class StoreMachine(RuleBasedStateMachine):
    backend = "ordinary"
    growth = False

    def __init__(self):
        super().__init__()
        policy = EntitlementPolicy(kv_lease_growth=True, window_tokens=64, cushion_tokens=16) if self.growth else None
        self.plan = tiny_plan(self.backend, pages=12)
        # a few pages of Host arena: offloads succeed often and run out now and then
        host_bytes = 3 * self.plan.pools[MAIN].layout.page_bytes
        self.store = KVStore(self.plan, entitlement=policy, host_bytes=host_bytes)
        self.kinds = self.store.pool_kinds
        self.S = self.store.max_context
        self.L = self.store.logical_pages
        self.live_seqs: dict = {}
        self.live_ckpts: dict = {}
        self.dead_seqs: list = []
        self.dead_ckpts: list = []
        self.shared_bytes: dict = {}  # (kind, physical page) -> bytes while shared
        self.in_flight: dict = {}  # OffloadPlan -> the checkpoint it copies (planned, not completed)
        self.counter = 1
        self.steps = 0

    # -- helpers ---------------------------------------------------------------------------------------
    def _values(self, n):
        out = [(self.counter + i) % 200 + 1 for i in range(n)]
        self.counter += n
        return out

    def _pick_seq(self, data):
        return data.draw(st.sampled_from(sorted(self.live_seqs, key=lambda h: h.id)))

    def _pick_ckpt(self, data):
        return data.draw(st.sampled_from(sorted(self.live_ckpts, key=lambda h: h.id)))

    def _has_pages(self):
        return any(any(content.values()) for content in self.live_ckpts.values())

    def _pick_ckpt_with_pages(self, data, placement=None):
        """A checkpoint holding at least one page (most Host-tier verbs are no-ops on empty ones),
        preferably one with a page of the given placement (``"device"``, ``"host"`` or ``"both"``)."""
        full = [ck for ck, content in self.live_ckpts.items() if any(content.values())]
        if placement is not None:
            fit = [ck for ck in full if self.store.checkpoint(ck).page_placement[placement]]
            full = fit if fit and data.draw(st.integers(0, 3)) else full
        return data.draw(st.sampled_from(sorted(full, key=lambda h: h.id))) if full else self._pick_ckpt(data)

    def _pinned(self, ck) -> bool:
        """Whether an offload plan in flight pins a page of ``ck`` (verbs that change it are refused)."""
        return any(p.pins for p in self._ck_pages(ck))

    def _refused_while_pinned(self, ck, fn) -> bool:
        """When ``ck`` is pinned, check that ``fn`` is refused (``LifecycleError``, nothing changed)."""
        if self._pinned(ck):
            self._unchanged(fn, LifecycleError)
            return True
        return False

    def _lead(self, kind):
        return self.store._rt[kind].lead_tokens

    def _unchanged(self, fn, exc):
        before = self.store.snapshot()
        with pytest.raises(exc):
            fn()
        assert_same(before, self.store.snapshot())

    # -- activation ------------------------------------------------------------------------------------
    @rule(prompt=st.integers(0, 160), budget=st.integers(0, 110))
    def activate_root(self, prompt, budget):
        if prompt + budget > self.S:
            self._unchanged(lambda: self.store.activate(prompt, budget), EntitlementError)
            return
        before = self.store.snapshot()
        try:
            h = self.store.activate(prompt, budget)
        except PoolCapacityError:
            assert_same(before, self.store.snapshot())
            return
        self.live_seqs[h] = _Seq(prompt + budget, {k: [] for k in self.kinds})

    @precondition(lambda self: self.live_ckpts)
    @rule(data=st.data(), extra=st.integers(0, 40), budget=st.integers(0, 80))
    def fork_checkpoint(self, data, extra, budget):
        self._activate_from(*self._pick_source(data), False, extra, budget)

    @precondition(lambda self: self.live_ckpts)
    @rule(data=st.data(), release=st.booleans(), extra=st.integers(0, 80), budget=st.integers(0, 120))
    def activate_from_checkpoint(self, data, release, extra, budget):
        self._activate_from(*self._pick_source(data), release, extra, budget)

    def _draw_cut(self, data, ck):
        """``source_tokens`` for an activation from ``ck``: ``None`` (the whole frontier) half the
        time, else mostly a prefix in ``[1, F]``, now and then a refused value (0, -1, ``F + 1``)."""
        f = len(self.live_ckpts[ck][MAIN])
        pick = data.draw(st.integers(0, 5))
        if pick < 3:
            return None
        if pick < 5 and f:
            return data.draw(st.integers(1, f))
        return data.draw(st.sampled_from([0, -1, f + 1]))

    def _pick_source(self, data):
        """A checkpoint to activate from and its ``source_tokens``: the whole frontier, a prefix of
        a checkpoint holding Main tokens (when there is one), or now and then a refused value."""
        pick = data.draw(st.integers(0, 7))
        if 3 <= pick < 7:
            held = sorted((ck for ck, c in self.live_ckpts.items() if c[MAIN]), key=lambda h: h.id)
            if held:
                ck = data.draw(st.sampled_from(held))
                return ck, data.draw(st.integers(1, len(self.live_ckpts[ck][MAIN])))
        ck = self._pick_ckpt(data)
        f = len(self.live_ckpts[ck][MAIN])
        return ck, data.draw(st.sampled_from([0, -1, f + 1])) if pick == 7 else None

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data(), release=st.booleans(), extra=st.integers(0, 40), budget=st.integers(0, 60))
    def activate_from_host(self, data, release, extra, budget):
        """Activation from a checkpoint with Host-only pages: the restore_host stage restores them.

        The checkpoint is evicted first (offload + drop) when it has no Host-only page, and since the
        pools are usually full, an active sequence is released first when there is one.
        """
        if self.live_seqs:
            h = self._pick_seq(data)
            self.store.finish(h)
            self.live_seqs.pop(h)
            self.dead_seqs.append(h)
        ck = self._pick_ckpt_with_pages(data, "host")
        self._evict(ck)
        self._activate_from(ck, self._draw_cut(data, ck), release, extra, budget)

    def _evict(self, ck):
        """Offload + drop when the checkpoint has no Host-only page yet (best effort)."""
        if not self.store.checkpoint(ck).page_placement["host"]:
            try:
                offload_checkpoint(self.store, ck, sync(self.store))
                self.store.drop_device_replica(ck)
            except (HostCapacityError, LifecycleError):
                pass

    def _activate_from(self, ck, cut, release, extra, budget):
        """Activate from ``ck`` (``cut``: ``source_tokens``, a prefix of it) and model the result:
        each pool continues from the cut less its lookahead, capped at its own frontier."""
        content = self.live_ckpts[ck]
        f = len(content[MAIN])
        valid = cut is None or 1 <= cut <= f
        prompt = (f if cut is None or not valid else cut) + extra
        if prompt + budget > self.S:
            self._unchanged(lambda: self.store.activate(prompt, budget, source=ck, source_tokens=cut),
                            EntitlementError)
            return
        if not valid:
            self._unchanged(lambda: self.store.activate(prompt, budget, source=ck, source_tokens=cut,
                                                        release_source=release), ValueError)
            return
        if cut is not None and cut < f:
            content = {k: v[: min(len(v), max(0, cut - PREFIX_LOOKAHEAD.get(k, 0)))] for k, v in content.items()}
        on_device = {k: [p.device_lease is not None for p in self.store.address_space(ck, k).pages()]
                     for k in self.kinds}
        before = self.store.snapshot()
        try:
            h = self.store.activate(prompt, budget, source=ck, source_tokens=cut, release_source=release)
        except PoolCapacityError:
            assert_same(before, self.store.snapshot())
            return
        except LifecycleError:  # a Move of pages an offload in flight pins
            assert release and self._pinned(ck)
            assert_same(before, self.store.snapshot())
            return
        self.live_seqs[h] = _Seq(prompt + budget, {k: list(v) for k, v in content.items()})
        if release:
            del self.live_ckpts[ck]
            self.dead_ckpts.append(ck)
        else:  # the pages the new sequence reads are restored for it, the others stay where they were
            for k in self.kinds:
                read = -(-len(content[k]) // P)
                pages = self.store.address_space(ck, k).pages()
                assert [p.device_lease is not None for p in pages] == [True] * read + on_device[k][read:]
        for k in self.kinds:
            assert self.store.address_space(h, k).committed_frontier == len(content[k])

    # -- units -----------------------------------------------------------------------------------------
    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data(), n=st.integers(1, 150), accept=st.lists(st.integers(0, 150), min_size=3, max_size=3),
          keep=st.integers(0, 70))
    def unit(self, data, n, accept, keep):
        """Map, write through the device table and settle, independently per pool (MTP leads)."""
        h = self._pick_seq(data)
        seq = self.live_seqs[h]
        row = self.store.row(h)
        for i, kind in enumerate(self.kinds):
            space = self.store.address_space(h, kind)
            c = space.committed_frontier
            reach = c + n + self._lead(kind)
            if reach > space.entitlement_tokens:
                error = TargetError if reach > self.L * P else EntitlementError
                self._unchanged(lambda: self.store.map(h, reach, pool=kind), error)
                continue
            blocks_before = space.num_blocks
            self.store.map(h, reach, pool=kind)
            assert space.num_blocks == max(blocks_before, -(-reach // P))
            vals = self._values(reach - c)
            write_tokens(self.store, kind, row, c, vals)
            a = min(accept[i], reach - c)
            provisional = min(c + a + keep, reach)
            self.store.settle(h, c + a, pool=kind, provisional=provisional)
            seq.content[kind].extend(vals[:a])
            assert space.num_blocks == -(-max(c + a, provisional) // P) or space.num_blocks == -(-(c + a) // P)

    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data(), n=st.integers(1, 100))
    def failed_unit(self, data, n):
        """A unit writes beyond the frontier in every pool but never commits: nothing visible changes."""
        h = self._pick_seq(data)
        row = self.store.row(h)
        for kind in self.kinds:
            space = self.store.address_space(h, kind)
            c = space.committed_frontier
            reach = min(c + n, space.entitlement_tokens)
            self.store.map(h, reach, pool=kind)
            write_tokens(self.store, kind, row, c, [255.0] * (reach - c))
            self.store.trim(h, pool=kind)

    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data(), n=st.integers(0, 300))
    def map_lower_bound(self, data, n):
        h = self._pick_seq(data)
        space = self.store.address_space(h, MAIN)
        if n > self.L * P:
            self._unchanged(lambda: self.store.map(h, n), TargetError)
            return
        if n > space.entitlement_tokens:
            self._unchanged(lambda: self.store.map(h, n), EntitlementError)
            return
        blocks, committed, ent = space.num_blocks, space.committed_frontier, space.entitlement_pages
        self.store.map(h, n)
        assert space.num_blocks == max(blocks, -(-n // P))
        assert space.committed_frontier == committed and space.entitlement_pages == ent

    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data(), back=st.integers(0, 130))
    def truncate(self, data, back):
        h = self._pick_seq(data)
        space = self.store.address_space(h, MAIN)
        c, lo = space.committed_frontier, space.protected_frontier
        to = c - back
        if to < lo:
            if lo > 0:
                self._unchanged(lambda: self.store.truncate(h, lo - 1), LifecycleError)
            to = lo
        self.store.truncate(h, to)
        del self.live_seqs[h].content[MAIN][to:]

    @precondition(lambda self: self.live_seqs)
    @rule()
    def decode_round(self):
        """One vectorized decode round over every active lane of the Main pool."""
        hs = [h for h in self.live_seqs if self.store.address_space(h, MAIN).entitlement_tokens
              > self.store.address_space(h, MAIN).committed_frontier]
        if not hs:
            return
        rows = np.array([self.store.row(h) for h in hs])
        c = np.array([self.store.address_space(h, MAIN).committed_frontier for h in hs])
        self.store.map(rows, c + 1)
        vals = self._values(len(hs))
        write_positions(self.store, MAIN, rows, c, vals)  # one batched write through the device table
        self.store.commit(rows, c + 1)
        for h, v in zip(hs, vals):
            self.live_seqs[h].content[MAIN].append(v)

    @rule(data=st.data(), verb=st.sampled_from(["map", "commit", "trim", "settle", "boundary"]),
          kind=st.sampled_from(["first", "idle", "range", "negative", "duplicate"]))
    def invalid_rows_rejected(self, data, verb, kind):
        """Row verbs refuse idle, out-of-range, negative and duplicated rows, changing nothing."""
        store = self.store
        C = store.max_concurrency
        active = store.active_rows().tolist()
        idle = sorted(set(range(C)) - set(active))
        if kind == "first" or kind == "range":
            bad = [C + data.draw(st.integers(0, 5))]  # the index space of the checkpoint slots
        elif kind == "idle":
            if not idle:
                return
            bad = [data.draw(st.sampled_from(idle))]
        elif kind == "negative":
            bad = [-data.draw(st.integers(1, 3))]
        else:
            if not active:
                return
            bad = [data.draw(st.sampled_from(active))] * 2
        rows = np.array(active[:1] + bad, np.int64) if kind != "duplicate" else np.array(bad, np.int64)
        pool = data.draw(st.sampled_from(self.kinds))
        ones = np.ones(rows.size, np.int64)
        fn = {
            "map": lambda: store.map(rows, ones, pool=pool),
            "commit": lambda: store.commit(rows, ones * 10**6, pool=pool),
            "trim": lambda: store.trim(rows, pool=pool),
            "settle": lambda: store.settle(rows, ones * 10**6, pool=pool),
            "boundary": lambda: store.round_boundary(rows),
        }[verb]
        self._unchanged(fn, RowError)

    @precondition(lambda self: self.growth)
    @rule()
    def round_boundary(self):
        grant = self.store.round_boundary()
        for r, cov, lim in zip(grant.rows, grant.covered_tokens, grant.length_limited):
            h = next(h for h in self.live_seqs if self.store.row(h) == r)
            c = self.store.address_space(h, MAIN).committed_frontier
            assert cov <= self.live_seqs[h].target
            assert bool(lim) == (cov < min(self.live_seqs[h].target, c + 1))

    # -- finish --------------------------------------------------------------------------------------------
    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data())
    def finish_retain(self, data):
        h = self._pick_seq(data)
        ck = self.store.finish(h, retain=True)
        seq = self.live_seqs.pop(h)
        self.dead_seqs.append(h)
        self.live_ckpts[ck] = seq.content
        info = self.store.checkpoint(ck)
        assert info.reusable and all(info.frontiers[k] == len(seq.content[k]) for k in self.kinds)

    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data())
    def finish_release(self, data):
        h = self._pick_seq(data)
        self.store.finish(h)
        self.live_seqs.pop(h)
        self.dead_seqs.append(h)

    @precondition(lambda self: self.live_ckpts)
    @rule(data=st.data())
    def release_checkpoint(self, data):
        ck = self._pick_ckpt(data)
        if self._refused_while_pinned(ck, lambda: self.store.release_checkpoint(ck)):
            return
        self.store.release_checkpoint(ck)
        del self.live_ckpts[ck]
        self.dead_ckpts.append(ck)

    # -- Host tier -----------------------------------------------------------------------------------------
    def _ck_pages(self, ck):
        return [p for k in self.kinds for p in self.store.address_space(ck, k).pages()]

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data(), then_drop=st.booleans())
    def offload(self, data, then_drop):
        """Offload a checkpoint; with ``then_drop`` also give up its Device replica (an eviction)."""
        ck = self._pick_ckpt_with_pages(data, "device")
        state = sync(self.store)
        if self._pinned(ck) and not all(p.placement in ("both", "host") for p in self._ck_pages(ck)):
            self._unchanged(lambda: offload_checkpoint(self.store, ck, state), LifecycleError)
            return
        before = self.store.snapshot()
        try:
            report = offload_checkpoint(self.store, ck, state)
        except HostCapacityError:
            assert_same(before, self.store.snapshot())
            return
        pages = self._ck_pages(ck)
        assert report.pages <= len(pages)
        assert all(p.placement in ("both", "host") for p in pages)
        assert self.store.checkpoint(ck).placement in (("both", "host") if pages else ("device",))
        if then_drop:
            self._drop(ck)

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data())
    def drop_device(self, data):
        self._drop(self._pick_ckpt_with_pages(data, "both"))

    def _drop(self, ck):
        if self._refused_while_pinned(ck, lambda: self.store.drop_device_replica(ck)):
            return
        pages = self._ck_pages(ck)
        on_device = [p for p in pages if p.device_lease is not None]
        if any(p.placement != "both" or p.active_references for p in on_device):
            self._unchanged(lambda: self.store.drop_device_replica(ck), LifecycleError)
            return
        allocated = sum(self.store.pool(k).allocated for k in self.kinds)
        assert self.store.drop_device_replica(ck) == len(on_device)
        assert sum(self.store.pool(k).allocated for k in self.kinds) == allocated - len(on_device)
        assert all(p.placement == "host" for p in pages)

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data(), drop_host=st.booleans())
    def restore(self, data, drop_host):
        ck = self._pick_ckpt_with_pages(data, "host")
        if self._pinned(ck):
            return  # eviction and restore are refused while pinned (checked by their own rules)
        self._evict(ck)
        before = self.store.snapshot()
        try:
            self.store.restore_checkpoint(ck, drop_host=drop_host)
        except PoolCapacityError:
            assert_same(before, self.store.snapshot())
            return
        pages = self._ck_pages(ck)
        assert all(p.device_lease is not None for p in pages)
        if drop_host:
            assert all(p.host_replica is None for p in pages)

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data())
    def release_host(self, data):
        ck = self._pick_ckpt_with_pages(data, "both")
        pages = self._ck_pages(ck)
        if any(p.device_lease is None or (p.pins and p.host_replica is not None) for p in pages):
            self._unchanged(lambda: self.store.release_host_replica(ck), LifecycleError)
            return
        hosted = sum(p.host_replica is not None for p in pages)
        assert self.store.release_host_replica(ck) == hosted
        assert self.store.checkpoint(ck).placement == "device"

    @precondition(lambda self: self._has_pages())
    @rule(data=st.data())
    def plan_offload_in_flight(self, data):
        """Plan an offload and leave it in flight: every later step's invariants hold with it."""
        ck = self._pick_ckpt_with_pages(data, "device")
        if self._pinned(ck):
            self._unchanged(lambda: self.store.plan_offload(ck), LifecycleError)
            return
        before = self.store.snapshot()
        try:
            plan = self.store.plan_offload(ck)
        except HostCapacityError:
            assert_same(before, self.store.snapshot())
            return
        self.in_flight[plan] = ck
        self.store.audit_invariants()

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), wrong=st.booleans())
    def complete_in_flight(self, data, wrong):
        """Complete a plan in flight with its own payload; another plan's payload (or a bare gather
        with no identity) is refused with nothing changed and the plan still in flight."""
        plans = sorted(self.in_flight, key=lambda p: p.token)
        plan = data.draw(st.sampled_from(plans))
        state = sync(self.store)
        others = [p for p in plans if p is not plan and p.pages]
        if wrong and others:
            other = data.draw(st.sampled_from(others))
            self._unchanged(lambda: self.store.complete_offload(plan, gather_offload(self.store, other, state)),
                            PayloadError)
            self._unchanged(lambda: self.store.complete_offload(plan, gather_pages(state, plan.pages)), TypeError)
            assert plan.status == "planned"
            return
        ck = self.in_flight.pop(plan)
        self.store.complete_offload(plan, gather_offload(self.store, plan, state))
        if ck in self.live_ckpts:
            assert all(p.placement in ("both", "host") for p in self._ck_pages(ck))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def cancel_in_flight(self, data):
        plan = data.draw(st.sampled_from(sorted(self.in_flight, key=lambda p: p.token)))
        del self.in_flight[plan]
        self.store.cancel_offload(plan)
        self._unchanged(lambda: self.store.cancel_offload(plan), LifecycleError)

    @precondition(lambda self: self.live_seqs)
    @rule(data=st.data(), verb=st.sampled_from(["map", "commit", "trim", "settle", "map_handle",
                                                "commit_handle", "trim_handle", "truncate", "settle_handle"]),
          value=st.sampled_from(["negative", "beyond"]))
    def bad_targets_rejected(self, data, verb, value):
        """One rule for targets in every row and handle verb: negative or beyond ``L * P`` is a
        ``TargetError`` naming the row and the value, nothing changed."""
        store = self.store
        h = self._pick_seq(data)
        row = store.row(h)
        bad = -data.draw(st.integers(1, 64)) if value == "negative" else self.L * P + data.draw(st.integers(1, 64))
        pool = data.draw(st.sampled_from(self.kinds))
        fn = {
            "map": lambda: store.map([row], [bad], pool=pool),
            "commit": lambda: store.commit([row], [bad], pool=pool),
            "trim": lambda: store.trim([row], [bad], pool=pool),
            "settle": lambda: store.settle([row], [bad], pool=pool),
            "map_handle": lambda: store.map(h, bad, pool=pool),
            "commit_handle": lambda: store.commit(h, bad, pool=pool),
            "trim_handle": lambda: store.trim(h, bad, pool=pool),
            "truncate": lambda: store.truncate(h, bad, pool=pool),
            "settle_handle": lambda: store.settle(h, bad, pool=pool),
        }[verb]
        before = store.snapshot()
        with pytest.raises(TargetError, match=f"= {bad} for row {row} is out of range"):
            fn()
        assert_same(before, store.snapshot())

    @precondition(lambda self: self.dead_seqs or self.dead_ckpts)
    @rule(data=st.data())
    def stale_handles_rejected(self, data):
        if self.dead_seqs:
            h = data.draw(st.sampled_from(self.dead_seqs))
            self._unchanged(lambda: self.store.finish(h), StaleHandleError)
            self._unchanged(lambda: self.store.commit(h, 0), StaleHandleError)
        if self.dead_ckpts:
            ck = data.draw(st.sampled_from(self.dead_ckpts))
            self._unchanged(lambda: self.store.release_checkpoint(ck), StaleHandleError)

    # -- invariants ------------------------------------------------------------------------------------------
    @rule(data=st.data(), slip=st.sampled_from(["skip", "repeat", "reorder", "lag", "blank"]), synced=st.booleans(),
          n=st.integers(1, 70))
    def slip_and_resync(self, data, slip, synced, n):
        """A caller's slip — a work skipped, repeated, reordered or never applied, or the state replaced
        by a blank one — with or without pending work, units written and committed over the damaged
        state, then ``resync``: what it does not report holds exactly the model's tokens (the
        invariant checks it), what it reports holds them up to its intact frontier, is refused, and is
        truncated back into service (or released)."""
        store, dev = self.store, device(self.store)
        if synced:
            dev.sync()
        if slip == "blank":
            dev.state = allocate_state(store, fill=float("nan"))
        else:
            w1, w2 = (w.pad_to(*dev.pad) if dev.pad else w for w in (store.take_work(), store.take_work()))
            order = {"skip": [w2], "repeat": [w1, w1], "reorder": [w2, w1], "lag": []}[slip]
            for w in order:
                dev.state = apply_work_jit(dev.state, w)
        if slip != "lag":  # units over the damaged state: the caller commits what the device dropped
            for h in data.draw(st.lists(st.sampled_from(sorted(self.live_seqs, key=lambda h: h.id)), unique=True))\
                    if self.live_seqs else []:
                c = store.address_space(h).committed_frontier
                if c + n + self._lead(MAIN) > store.address_space(h).entitlement_tokens:
                    continue
                store.map(h, c + n)
                vals = self._values(n)
                write_tokens(store, MAIN, store.row(h), c, vals)
                store.commit(h, c + n)
                self.live_seqs[h].content[MAIN].extend(vals)
        dev.state, report = resync(store, dev.state)
        dev.works = store.work_serial
        assert all(plan.status == "cancelled" for plan in self.in_flight)  # a resync cancels them all
        self.in_flight.clear()
        store.require_synced(dev.state)
        store.audit_invariants()
        assert dict(store.lost()) == {**report.lost_sequences, **report.lost_checkpoints}
        planes = {k: {n_: np.asarray(v) for n_, v in dev.state.pool_planes(k).items()} for k in self.kinds}
        for h, intact in report.lost_sequences.items():
            content = self.live_seqs[h].content
            assert any(intact[k] < len(content[k]) for k in self.kinds)
            for k in self.kinds:
                assert content_ok(store, k, h, content[k][: intact[k]], planes[k])
            with pytest.raises(LostContentError):
                store.map(h, 1)
            if all(intact[k] >= store.address_space(h, k).protected_frontier for k in self.kinds):
                for k in self.kinds:
                    store.truncate(h, intact[k], pool=k)
                    content[k] = content[k][: intact[k]]
                assert h not in store.lost()
            else:
                store.finish(h)
                del self.live_seqs[h]
                self.dead_seqs.append(h)
        for ck, intact in report.lost_checkpoints.items():
            for k in self.kinds:
                assert content_ok(store, k, ck, self.live_ckpts[ck][k][: intact[k]], planes[k])
            with pytest.raises(LostContentError):
                store.activate(0, 0, source=ck)
            store.release_checkpoint(ck)
            del self.live_ckpts[ck]
            self.dead_ckpts.append(ck)
        assert store.lost() == {}
        self.shared_bytes.clear()  # replays rewrite pages: shared pages are tracked afresh

    @invariant()
    def consistent(self):
        self.steps += 1
        store = self.store
        store.audit_invariants()
        state = sync(store)
        store.require_synced(state)  # every work applied once, in order
        tables = {k: np.asarray(t) for k, t in state.tables.items()}
        active_rows = sorted(store.row(h) for h in self.live_seqs)
        assert active_rows == sorted(store.active_rows().tolist())
        assert len(set(active_rows)) == len(active_rows)
        for kind in self.kinds:
            pool = store.pool(kind)
            assert pool.allocated + pool.reserved + pool.available == pool.capacity
            planes_np = {n: np.asarray(v) for n, v in planes_of(store, kind).items()}
            axis = store.layout(kind).order.page_axis
            owners: dict = {}
            reserved = 0
            mapped_pages = set()
            for h, seq in self.live_seqs.items():
                space = store.address_space(h, kind)
                phys = space.physical_pages
                mapped_pages.update(phys.tolist())
                assert space.committed_frontier == len(seq.content[kind])
                assert space.mapped_tokens >= space.committed_frontier
                assert space.reserved_pages == space.entitlement_pages - space.num_blocks
                reserved += space.reserved_pages
                row = store.row(h)
                assert np.array_equal(tables[kind][row, : phys.size], phys)
                assert (tables[kind][row, phys.size :] == SENTINEL_PAGE).all()
                assert space_content_ok(store, kind, phys, seq.content[kind], planes_np)
                pb = space.protected_frontier // P
                for b, p in enumerate(phys.tolist()):
                    owners.setdefault(p, []).append(("w" if b >= pb else "r", h))
            for ck, content in self.live_ckpts.items():
                space = store.address_space(ck, kind)
                phys = space.physical_pages
                on_device = phys[phys >= 0].tolist()  # -1: Host-only page
                mapped_pages.update(on_device)
                assert not space.active and space.row is None
                assert space.committed_frontier == len(content[kind]) and phys.size == -(-len(content[kind]) // P)
                assert content_ok(store, kind, ck, content[kind], planes_np)
                for p in on_device:
                    owners.setdefault(p, []).append(("r", ck))
            for r in set(range(store.max_concurrency)) - set(active_rows):
                assert (tables[kind][r] == SENTINEL_PAGE).all()
            assert pool.allocated == len(mapped_pages)
            assert pool.reserved == reserved
            for p, holders in owners.items():
                writers = [x for x in holders if x[0] == "w"]
                assert len(writers) <= 1 and (not writers or len(holders) == 1), f"page {p}: {holders}"
                key = (kind, p)
                if len(holders) > 1:
                    now = page_bytes(planes_np, axis, p)
                    assert self.shared_bytes.setdefault(key, now) == now, f"shared page {p} changed"
                else:
                    self.shared_bytes.pop(key, None)

    def teardown(self):
        store = self.store
        for plan in list(self.in_flight):
            store.cancel_offload(plan)
        for h in list(self.live_seqs):
            store.finish(h)
        for ck in list(self.live_ckpts):
            store.release_checkpoint(ck)
        store.audit_invariants()
        for kind in self.kinds:
            occ = store.occupancy(kind)
            assert occ.allocated == 0 and occ.reserved == 0 and occ.available == occ.capacity
            assert occ.logical_pages == 0 and occ.active_spaces == 0 and occ.retained_checkpoints == 0
        assert (store.host_block_table() == SENTINEL_PAGE).all()
        occ = store.host_occupancy()
        assert occ.extent_count == 0 and occ.free_extent_count == 1 and occ.free_bytes == occ.capacity


# The default run: 30 examples of 20 steps per machine (the deep run below: -m slow).
SETTINGS = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class OrdinaryMachine(StoreMachine):
    backend = "ordinary"


class MTPMachine(StoreMachine):
    backend = "mtp"


class DFlashMachine(StoreMachine):
    backend = "dflash"


class GrowthMachine(StoreMachine):
    backend = "mtp"
    growth = True


TestOrdinary = OrdinaryMachine.TestCase
TestOrdinary.settings = SETTINGS
TestMTP = MTPMachine.TestCase
TestMTP.settings = SETTINGS
TestDFlash = DFlashMachine.TestCase
TestDFlash.settings = SETTINGS
TestGrowth = GrowthMachine.TestCase
TestGrowth.settings = SETTINGS

# The deep run (``-m slow``): every machine at 400 examples.
_DEEP = settings(SETTINGS, max_examples=400)
for _machine in (OrdinaryMachine, MTPMachine, DFlashMachine, GrowthMachine):
    _deep = type(f"TestDeep{_machine.backend.capitalize()}{'Growth' if _machine.growth else ''}",
                 (_machine.TestCase,), {"settings": _DEEP})
    globals()[_deep.__name__] = pytest.mark.slow(_deep)
del _machine, _deep
