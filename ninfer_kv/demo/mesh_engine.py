"""The demo's engine over a KV cache sharded on a ``data x model`` mesh.

One :class:`ShardedKVStore` holds a :class:`KVStore` per data shard; the scheduler serves each
shard's requests with its own :class:`MeshEngine`, prefix cache and lanes, over the shard's store
(:class:`ShardStore`: local handles and rows, offloads gathered per device).  All engines share one
sharded :class:`~ninfer_kv.KVDeviceState` and one step runner (:class:`MeshState`).  The shards'
rounds run in lockstep (:mod:`ninfer_kv.demo.lockstep`): a unit of shard ``d`` parks until every
shard reached a unit or ended its round, then the parked units of one kind run as *one* mesh step
with batch ``D * b``: shard ``d``'s lanes in slots ``[d * b, (d + 1) * b)`` as global rows
``d * C_local + local row``, the slots of shards without such a unit the inert row ``C``; the round
work of every shard is taken and applied with it, each shard on its own devices.
"""

from __future__ import annotations

import jax
import numpy as np

from ..device.sharded_ops import sharded_apply_work
from ..models.decoder import bucket_for, pad_rows
from ..models.decoder.mesh_steps import MeshSteps
from ..store import KVDeviceState
from ..store.sharded import ShardedCheckpoint, ShardedKVStore
from .engine import ModelEngine
from .lockstep import LockstepRounds

__all__ = ["MeshState", "ShardStore", "MeshEngine"]


class MeshState:
    """The one sharded device state of a :class:`ShardedKVStore` and the runner of the merged mesh
    steps, shared by the shards' engines.

    Args:
      sharded: the sharded store.
      steps: the :class:`MeshSteps` (global buckets ``D * b``).
      params: model parameters (replicated).
      local_buckets: the per-shard batch buckets ``b``.

    Attributes:
      lockstep: the :class:`LockstepRounds` coordinator the engines submit their units to.
      lanes: real lanes of every merged step run so far, in order (``D * b`` slots each).
    """

    def __init__(self, sharded: ShardedKVStore, steps: MeshSteps, params: dict, local_buckets):
        self.sharded = sharded
        self.steps = steps
        self.params = params
        self.local_buckets = tuple(local_buckets)
        self.state: KVDeviceState = sharded.allocate_state()
        mesh = sharded.kv_mesh
        self._apply = jax.jit(lambda s, w: sharded_apply_work(mesh, s, w), donate_argnums=0)
        self.work_shape = None  # set by the first engine (every shard's store has one geometry)
        self.lockstep = LockstepRounds(self._run_units)
        self.lanes: list[int] = []
        self.slots: list[int] = []

    def flush(self) -> KVDeviceState:
        """The state with every shard's pending round work applied."""
        if any(not p.empty for s in self.sharded.shards for p in s.pending_work().values()):
            self.state = self._apply(self.state, self.sharded.take_work().device_put(self.sharded.kv_mesh))
        return self.state

    def _run_units(self, name: str, units: list) -> None:
        """One mesh step of ``name`` for the parked ``units`` (one per shard): each shard's lanes in
        its slot range, every other slot the inert row; each unit gets its slice of the outputs."""
        sharded = self.sharded
        d = sharded.num_shards
        bucket = bucket_for(max(len(u.inputs[3]) for u in units), self.local_buckets)
        total = bucket * d
        inert = sharded.max_concurrency
        width = units[0].inputs[0].shape[1]
        tokens = np.zeros((total, width), np.int32)
        pos = np.zeros(total, np.int32)
        val = np.zeros(total, np.int32)
        table_rows = np.full(total, inert, np.int32)
        for u in units:
            lead, positions, valid, rows = u.inputs
            padded = pad_rows(lead, positions, valid, rows, bucket=bucket, scratch_row=inert)
            lo = u.shard * bucket
            tokens[lo : lo + bucket], pos[lo : lo + bucket] = padded.tokens, padded.positions
            val[lo : lo + bucket], table_rows[lo : lo + bucket] = padded.valid, padded.table_rows
        self.state, work = sharded.take_step_work(self.state, self.work_shape)
        self.state, out = self.steps.on_state(name)(self.params, self.state, work, tokens, pos, val, table_rows)
        fields = {field: np.asarray(x) for field, x in out._asdict().items() if x is not None}
        for u in units:
            lo = u.shard * bucket
            u.output = out._replace(**{field: x[lo : lo + bucket] for field, x in fields.items()})
        self.lanes.append(sum(len(u.inputs[3]) for u in units))
        self.slots.append(total)


class ShardStore:
    """Data shard ``shard``'s :class:`KVStore` as the scheduler and the prefix cache see it:
    every verb is the shard's own (local handles, rows and pages), except the Host offload,
    which gathers the pages from the sharded state on the shard's devices."""

    def __init__(self, sharded: ShardedKVStore, shard: int):
        self._sharded = sharded
        self._store = sharded.store(shard)
        self.shard = shard

    def __getattr__(self, name):
        return getattr(self._store, name)

    def offload_checkpoint(self, checkpoint, state):
        return self._sharded.offload_checkpoint(ShardedCheckpoint(self.shard, checkpoint), state)


class MeshEngine(ModelEngine):
    """A :class:`ModelEngine` for the lanes of one data shard (main model only).

    Args:
      steps: :class:`MeshSteps` (global buckets ``D * b`` for every local bucket ``b``).
      params: model parameters (replicated).
      shared: the :class:`MeshState` of the sharded store.
      shard: this engine's data shard.
      fingerprint: as :class:`ModelEngine`.
    """

    def __init__(self, steps: MeshSteps, params: dict, shared: MeshState, shard: int, fingerprint: str):
        self.shared = shared
        self.sharded = shared.sharded
        self.shard = shard
        super().__init__(steps, params, ShardStore(self.sharded, shard), fingerprint)
        d = self.sharded.num_shards
        self.buckets = tuple(b // d for b in steps.config.batch_buckets)

    @property
    def state(self) -> KVDeviceState:
        return self.shared.state

    @state.setter
    def state(self, value: KVDeviceState) -> None:
        self.shared.state = value

    def _allocate_state(self) -> KVDeviceState:
        return self.shared.state

    def flushed_state(self) -> KVDeviceState:
        return self.shared.flush()

    def _call(self, name, kind, lead, positions, valid, rows, next_tokens=None):
        if next_tokens is not None:
            raise ValueError("the mesh engine runs the main model only (no MTP steps)")
        self.stats.units[name] = self.stats.units.get(name, 0) + 1
        if self.shared.work_shape is None:
            self.shared.work_shape = self.work_shape
        rows_global = np.asarray(rows, np.int64) + self.shard * self.sharded.rows_per_shard
        out = self.shared.lockstep.submit(self.shard, name, (np.asarray(lead), positions, valid, rows_global))
        self.stats.buckets.setdefault(name, set()).add(len(out.next_tokens) * self.sharded.num_shards)
        return out
