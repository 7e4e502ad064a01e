"""Stateful test of the sharded store's bookkeeping (no devices): random sequences of the store's
verbs over several data shards, with invalid input mixed in.

Invariants after every step, per shard: the store's own invariants (``allocated + reserved +
available == capacity`` in every pool, single writer, shared full pages immutable, rows owned by
their sequences), every sequence's global row inside its shard's row range, and a checkpoint never
activated from another shard.  A refused call leaves every shard's snapshot exactly as it was.  At
teardown everything is released and every shard's pools are whole again (no leaked pages).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from ninfer_kv.schema.errors import EntitlementError, PoolCapacityError
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache_mesh
from ninfer_kv.store.sharded import CrossShardError, ShardedKVStore

from .test_sharded_bookkeeping import _same

SHARDS = 2
PLAN = plan_kv_cache_mesh(ModelKVConfig(1, 2, 64, "k8v4"), f"data={SHARDS},model=1", max_context=256,
                          max_concurrency=4 * SHARDS, policy=ExplicitCapacity(SHARDS * 640))


class ShardedStoreMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")
    checkpoints = Bundle("checkpoints")

    def __init__(self):
        super().__init__()
        self.store = ShardedKVStore(PLAN)
        self.frontier: dict = {}  # sequence -> committed tokens
        self.home: dict = {}      # sequence or checkpoint -> the shard it was placed on

    def _refused(self, call, *errors) -> bool:
        before = self.store.snapshot()
        try:
            call()
        except errors:
            assert _same(self.store.snapshot(), before), "a refused call changed the store"
            return True
        return False

    @rule(target=sequences, shard=st.integers(0, SHARDS - 1), prompt=st.integers(0, 100), budget=st.integers(0, 40))
    def activate(self, shard, prompt, budget):
        out = []
        if not self._refused(lambda: out.append(self.store.activate(prompt, budget, shard=shard)),
                             PoolCapacityError, EntitlementError):
            h = out[0]
            self.frontier[h], self.home[h] = 0, shard
            return h
        return None

    @rule(target=sequences, ck=checkpoints, extra=st.integers(0, 40), other=st.booleans())
    def fork(self, ck, extra, other):
        if ck is None:
            return None
        home = self.home[ck]
        frontier = self.store.checkpoint(ck).frontiers
        prompt = int(max(frontier.values())) + extra
        if other:  # a checkpoint of another shard is refused, whole
            refused = self._refused(
                lambda: self.store.activate(prompt, 0, shard=(home + 1) % SHARDS, source=ck), CrossShardError
            )
            assert refused, "an activation from another shard's checkpoint was accepted"
            return None
        out = []
        if not self._refused(lambda: out.append(self.store.activate(prompt, 8, shard=home, source=ck)),
                             PoolCapacityError, EntitlementError, ValueError):
            h = out[0]
            self.frontier[h], self.home[h] = int(frontier[next(iter(frontier))]), home
            return h
        return None

    @rule(seqs=st.lists(sequences, min_size=1, max_size=4, unique_by=id), step=st.integers(1, 12))
    def map_and_commit(self, seqs, step):
        seqs = [h for h in seqs if h is not None and h in self.frontier]
        if not seqs or len({self.store.row(h) for h in seqs}) != len(seqs):
            return
        rows = np.array([self.store.row(h) for h in seqs])
        targets = np.array([self.frontier[h] + step for h in seqs])
        if self._refused(lambda: self.store.map(rows, targets), EntitlementError):
            return
        self.store.commit(rows, targets)
        for h, t in zip(seqs, targets):
            self.frontier[h] = int(t)

    @rule(row=st.integers(-2, 4 * SHARDS + 1))
    def bad_row(self, row):
        active = {self.store.row(h) for h in self.frontier}
        if row in active:
            return
        assert self._refused(lambda: self.store.commit([row], [1]), ValueError), f"row {row} was accepted"

    @rule(target=checkpoints, h=consumes(sequences), retain=st.sampled_from([True, True, True, False]))
    def finish(self, h, retain):  # retained 3 times in 4
        if h is None or h not in self.frontier:
            return None
        shard = self.home.pop(h)
        del self.frontier[h]
        ck = self.store.finish(h, retain=retain)
        if ck is None:
            return None
        assert self.store.shard_of(ck) == shard
        self.home[ck] = shard
        return ck

    @rule(ck=consumes(checkpoints))
    def release(self, ck):
        if ck is None or ck not in self.home:
            return
        self.store.release_checkpoint(ck)
        del self.home[ck]

    @invariant()
    def shards_are_consistent(self):
        self.store.audit_invariants()
        for occ in self.store.occupancy():
            assert occ.allocated + occ.reserved + occ.available == occ.capacity
        per = self.store.rows_per_shard
        for h in self.frontier:
            assert self.store.row(h) // per == self.home[h] == self.store.shard_of(h)

    def teardown(self):
        for h in list(self.frontier):
            self.store.finish(h)
        for ck in [k for k in self.home if k not in self.frontier]:
            self.store.release_checkpoint(ck)
        self.store.audit_invariants()
        for occ in self.store.occupancy():
            assert occ.available == occ.capacity and occ.logical_pages == 0, occ


TestShardedStore = ShardedStoreMachine.TestCase
TestShardedStore.settings = settings(
    max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
