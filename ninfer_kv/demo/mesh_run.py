"""Serve a demo workload over a ``data x model`` mesh (``ninfer-kv demo --mesh data=D,model=T``).

The scheduler, not the store, places every request on a data shard (:func:`shard_for`): a request
of system prompt ``g`` goes to shard ``g % D``, so its prefix checkpoint and every fork of it live on
one shard (pages never cross shards); a request without one goes to shard ``id % D``.  Each shard
has its own scheduler, prefix cache and engine over its :class:`KVStore`; their rounds run in
lockstep over the one sharded device state, every unit kind of a round one mesh step for all the
shards' lanes together (:mod:`ninfer_kv.demo.lockstep`, :mod:`ninfer_kv.demo.mesh_engine`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax

from ..mesh import KVMesh
from ..models.decoder import StepConfig
from ..models.decoder.mesh_steps import MeshSteps
from ..store.sharded import ShardedKVStore
from .engine import UnitStats
from .mesh_engine import MeshEngine, MeshState
from .prefix_cache import PrefixCache, PressureStats
from .requests import Request
from .scheduler import Scheduler, SchedulerStats

__all__ = ["shard_for", "MeshServing", "serve_mesh", "mesh_step_config"]


def shard_for(request: Request, data_shards: int) -> int:
    """The data shard the demo puts ``request`` on (its system prompt's shard, else ``id % D``)."""
    key = request.prefix_group if request.prefix_group is not None else request.id
    return int(key) % data_shards


def mesh_step_config(step_config: StepConfig, local_buckets: Sequence[int], data_shards: int) -> StepConfig:
    """``step_config`` with the global batch buckets ``D * b`` of the per-shard buckets ``b``."""
    return dataclasses.replace(step_config, batch_buckets=tuple(data_shards * b for b in local_buckets))


@dataclasses.dataclass
class MeshServing:
    """What a mesh run served: the sharded store, the steps, and every shard's parts."""

    sharded: ShardedKVStore
    steps: MeshSteps
    shared: MeshState
    engines: list
    caches: list
    schedulers: list

    @property
    def records(self) -> list:
        return [r for s in self.schedulers for r in s.records]

    def step_stats(self) -> dict:
        """Mesh steps run and the real lanes they served (each step has ``D * b`` batch slots)."""
        lanes, slots = self.shared.lanes, self.shared.slots
        steps = len(lanes)
        return {
            "steps": steps,
            "lanes_per_step": sum(lanes) / steps if steps else 0.0,
            "max_lanes_per_step": max(lanes, default=0),
            "slots_per_step": sum(slots) / steps if steps else 0.0,
        }


def serve_mesh(plan, kv_mesh: KVMesh, step_config: StepConfig, local_buckets: Sequence[int], params: dict,
               fingerprint: str, requests: Sequence[Request], *, entitlement, host_bytes: int | None,
               on_finish: Callable | None = None, before_serve: Callable | None = None) -> MeshServing:
    """Build the sharded store, the mesh steps and one scheduler per data shard; serve ``requests``.

    ``before_serve(steps)`` is called once the steps exist, before the first round."""
    sharded = ShardedKVStore(plan, kv_mesh, entitlement=entitlement, requires_state_image=True, host_bytes=host_bytes)
    d = kv_mesh.data
    steps = MeshSteps(mesh_step_config(step_config, local_buckets, d), kv_mesh, sharded.layout("main"))
    shared = MeshState(sharded, steps, params, local_buckets)
    engines = [MeshEngine(steps, params, shared, s, fingerprint) for s in range(d)]
    caches = [PrefixCache(e.store, shared.flush) for e in engines]
    parts: list[list[Request]] = [[] for _ in range(d)]
    for r in requests:
        parts[shard_for(r, d)].append(r)
    schedulers = [Scheduler(e, c, p, on_finish=on_finish) for e, c, p in zip(engines, caches, parts)]
    if before_serve is not None:
        before_serve(steps)
    while any(s.busy for s in schedulers):
        shared.lockstep.round([(i, s.step_round) for i, s in enumerate(schedulers) if s.busy])
    jax.block_until_ready(shared.state)
    sharded.check_state(shared.state)  # every shard's round work applied once, in order
    return MeshServing(sharded, steps, shared, engines, caches, schedulers)


def merge_scheduler_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Counters summed over shards; ``rounds`` the most rounds of a shard (they run in lockstep)."""
    out = SchedulerStats()
    for s in stats:
        for f in dataclasses.fields(SchedulerStats):
            mine, theirs = getattr(out, f.name), getattr(s, f.name)
            if isinstance(theirs, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            elif f.name == "rounds":
                out.rounds = max(out.rounds, theirs)
            else:
                setattr(out, f.name, mine + theirs)
    return out


def merge_unit_stats(stats: Sequence[UnitStats]) -> UnitStats:
    """Unit counters summed over shards (bucket sets united)."""
    out = UnitStats()
    for s in stats:
        for f in dataclasses.fields(UnitStats):
            theirs = getattr(s, f.name)
            if f.name == "units":
                for k, v in theirs.items():
                    out.units[k] = out.units.get(k, 0) + v
            elif f.name == "buckets":
                for k, v in theirs.items():
                    out.buckets.setdefault(k, set()).update(v)
            else:
                setattr(out, f.name, getattr(out, f.name) + theirs)
    return out


def merge_pressure_stats(stats: Sequence[PressureStats]) -> PressureStats:
    return PressureStats(**{f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(PressureStats)})
