"""The demo's engine over a KV cache sharded on a ``data x model`` mesh.

One :class:`ShardedKVStore` holds a :class:`KVStore` per data shard; the scheduler serves each
shard's requests with its own :class:`MeshEngine`, prefix cache and lanes, over the shard's store
(:class:`ShardStore`: local handles and rows, offloads gathered per device).  All engines share one
sharded :class:`~ninfer_kv.KVDeviceState` (:class:`MeshState`).  A unit of shard ``d`` runs the
mesh step with batch ``D * B_local``: its lanes in slots ``[d * B_local, (d + 1) * B_local)`` as
global rows ``d * C_local + local row``, every other slot the inert row ``C``; the round work of
every shard is taken and applied with it, each shard on its own devices.
"""

from __future__ import annotations

import jax
import numpy as np

from ..models.qwen_tiny import bucket_for, pad_rows
from ..models.qwen_tiny.mesh_steps import MeshSteps
from ..sharded_ops import sharded_apply_work
from ..store import KVDeviceState
from ..store.sharded import ShardedCheckpoint, ShardedKVStore
from .engine import ModelEngine

__all__ = ["MeshState", "ShardStore", "MeshEngine"]


class MeshState:
    """The one sharded device state of a :class:`ShardedKVStore`, shared by the shards' engines."""

    def __init__(self, sharded: ShardedKVStore):
        self.sharded = sharded
        self.state: KVDeviceState = sharded.allocate_state()
        mesh = sharded.kv_mesh
        self._apply = jax.jit(lambda s, w: sharded_apply_work(mesh, s, w), donate_argnums=0)

    def flush(self) -> KVDeviceState:
        """The state with every shard's pending round work applied."""
        if any(not p.empty for s in self.sharded.shards for p in s.pending_work().values()):
            self.state = self._apply(self.state, self.sharded.take_work().device_put(self.sharded.kv_mesh))
        return self.state


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

    def _step_work(self):
        self.state, work = self.sharded.take_step_work(self.state, self.work_shape)
        return work

    def flushed_state(self) -> KVDeviceState:
        return self.shared.flush()

    def _call(self, name, kind, lead, positions, valid, rows, next_tokens=None):
        if next_tokens is not None:
            raise ValueError("the mesh engine runs the main model only (no MTP steps)")
        n = len(rows)
        bucket = bucket_for(n, self.buckets)
        sharded = self.sharded
        total = bucket * sharded.num_shards  # the step's batch: B_local slots per data shard
        self.stats.units[name] = self.stats.units.get(name, 0) + 1
        self.stats.buckets.setdefault(name, set()).add(total)
        inert = sharded.max_concurrency
        rows_global = np.asarray(rows, np.int64) + self.shard * sharded.rows_per_shard
        padded = pad_rows(lead, positions, valid, rows_global, bucket=bucket, scratch_row=inert)
        lo = self.shard * bucket
        tokens = np.zeros((total, padded.tokens.shape[1]), np.int32)
        pos = np.zeros(total, np.int32)
        val = np.zeros(total, np.int32)
        table_rows = np.full(total, inert, np.int32)
        tokens[lo : lo + bucket], pos[lo : lo + bucket] = padded.tokens, padded.positions
        val[lo : lo + bucket], table_rows[lo : lo + bucket] = padded.valid, padded.table_rows
        work = self._step_work()
        self.state, out = self.steps.on_state(name)(self.params, self.state, work, tokens, pos, val, table_rows)
        return out._replace(**{
            field: np.asarray(x)[lo : lo + bucket] for field, x in out._asdict().items() if x is not None
        })
