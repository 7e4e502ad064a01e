"""Serve a demo workload through the public engine (:mod:`ninfer_kv.engine`).

One device: an :class:`~ninfer_kv.engine.EngineCore` over a :class:`~ninfer_kv.store.KVStore` (the
MTP pool too with ``--speculative mtp``: the engine decodes in speculative rounds).  A mesh: a
:class:`~ninfer_kv.engine.data_parallel.DataParallelEngine` over a
:class:`~ninfer_kv.store.sharded.ShardedKVStore`.  Every request is submitted at once, greedy, with
its log-probabilities when the dense check will read them; the engine queues, admits by
entitlement, reuses cached prefixes at any token, offloads them to the Host tier under pressure and
batches prefill chunks with decodes.  Afterwards every cached prefix is released and the pages and
Host extents still held are counted (both must be 0).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from ..engine import DecoderModel, EngineCore, SamplingParams
from ..engine.outputs import FINISH_LENGTH
from ..device.mesh import KVMesh
from ..store import EntitlementPolicy, KVStore
from .requests import Request

__all__ = ["RequestRecord", "Served", "serve", "DENSE_LOGPROBS"]

DENSE_LOGPROBS = 8
"""Alternatives whose log-probabilities each generated token reports for the dense check."""


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """A finished request.

    Attributes:
      request: the workload's request.
      generated: int32 generated tokens.
      logprobs: per generated token, ``{token id: log-probability}`` of the token and the
        :data:`DENSE_LOGPROBS` most likely ones (empty without the dense check).
      finish_reason: ``"stop"`` (an EOS id) or ``"length"``.
      bounded: the request ended before its budget because its lease could not grow.
      cached_tokens: prompt tokens reused from the prefix cache.
    """

    request: Request
    generated: np.ndarray
    logprobs: tuple
    finish_reason: str
    bounded: bool
    cached_tokens: int

    @property
    def prefix_hit(self) -> bool:
        return self.cached_tokens > 0


@dataclasses.dataclass
class Served:
    """What serving produced: records in completion order, the engine's counters, the peaks sampled
    after every round, what was left once the cache was cleared, and the step log."""

    records: list
    stats: object  # EngineStats (summed over data shards)
    cache: dict  # CacheStats fields (summed)
    host_tier: bool
    offloaded_pages: int
    restored_pages: int
    peak_pages: dict
    peak_active: int
    peak_host_bytes: int
    pool_pages: dict
    leaked_pages: int
    leaked_extents: int
    units: dict
    buckets: dict
    compiles: dict
    mesh_steps: dict | None = None


def _policy(config) -> EntitlementPolicy:
    return EntitlementPolicy(kv_lease_growth=config.kv_lease_growth, window_tokens=config.lease_window_tokens,
                             cushion_tokens=config.lease_cushion_tokens)


def _engine(config, plan, params):
    """``(engine, stores, caches, runner log, step compile counts before)`` for a run."""
    host = config.host_bytes or None
    if config.mesh is None:
        store = KVStore(plan, entitlement=_policy(config), host_bytes=host)
        model = DecoderModel(params, config.model_config, impl=config.impl,
                             draft_window=config.draft_window if config.speculative == "mtp" else 0)
        engine = EngineCore(model, store, eos_token_ids=config.stop_tokens, seed=config.seed)
        return engine, [store], [engine], engine.runner
    from ..engine.data_parallel import DataParallelEngine
    from ..store.sharded import ShardedKVStore

    kv_mesh = KVMesh(config.mesh)
    sharded = ShardedKVStore(plan, kv_mesh, entitlement=_policy(config), host_bytes=host)
    model = DecoderModel(params, config.model_config, impl=config.impl, mesh=kv_mesh)
    engine = DataParallelEngine(model, sharded, eos_token_ids=config.stop_tokens, seed=config.seed)
    return engine, [c.store for c in engine.cores], engine.cores, engine.runner


def _host_counters(store) -> tuple[int, int]:
    """``(offloaded_pages, restored_pages)`` counted by a store's Host tier (0 without one)."""
    if store.host_occupancy() is None:
        return 0, 0
    c = store.host_counters()
    return int(c["offloaded_pages"]), int(c["restored_pages"])


def serve(config, plan, requests: Sequence[Request], params: dict, *, dense_check: bool,
          on_finish: Callable[[RequestRecord], None] | None = None, begin: Callable[[], None] | None = None) -> Served:
    """Serve ``requests`` through the engine of ``config`` (module docstring)."""
    engine, stores, cores, runner = _engine(config, plan, params)
    model_steps = runner.model.steps
    compiles_before = model_steps.compiles()
    by_id = {str(r.id): r for r in requests}
    for r in requests:
        params_r = SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0,
                                  logprobs=DENSE_LOGPROBS if dense_check else None)
        engine.add_request(str(r.id), r.prompt, params_r)
    if begin is not None:
        begin()
    records: list[RequestRecord] = []
    peaks: dict = {}
    peak_active = peak_host = 0
    while engine.has_unfinished():
        outputs = engine.step()
        peak_active = max(peak_active, engine.num_running)
        _sample_peaks(stores, peaks)
        occupancy = [s.host_occupancy() for s in stores]
        if occupancy[0] is not None:
            peak_host = max(peak_host, sum(int(o.used_bytes) for o in occupancy))
        for out in outputs:
            if not out.finished:
                continue
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            req = by_id[out.request_id]
            done = out.outputs[0]
            generated = np.asarray(done.token_ids, np.int32)
            logprobs = tuple({int(t): float(lp.logprob) for t, lp in pos.items()} for pos in (done.logprobs or ()))
            bounded = done.finish_reason == FINISH_LENGTH and generated.size < req.max_new_tokens
            record = RequestRecord(req, generated, logprobs, done.finish_reason, bounded, out.num_cached_tokens)
            records.append(record)
            if on_finish is not None:
                on_finish(record)
    jax.block_until_ready(runner.state)
    return _finish(config, engine, stores, cores, runner, records, peaks, peak_active, peak_host,
                   model_steps, compiles_before)


def _sample_peaks(stores, peaks: dict) -> None:
    used: dict = {}
    for store in stores:
        for kind in store.pool_kinds:
            pool = store.pool(kind)
            used[kind.value] = used.get(kind.value, 0) + pool.capacity - pool.available
    for k, v in used.items():
        peaks[k] = max(peaks.get(k, 0), v)


def _finish(config, engine, stores, cores, runner, records, peaks, peak_active, peak_host, model_steps,
            compiles_before) -> Served:
    if config.mesh is None:
        stores[0].require_synced(runner.state)  # every round work applied once, in order
    else:
        runner.sharded.require_synced(runner.state)
    cache: dict = {}
    for core in cores:
        for k, v in dataclasses.asdict(core.cache.stats).items():
            cache[k] = cache.get(k, 0) + v
    host_tier = cores[0].cache.host_tier
    offloaded = restored = 0
    for store in stores:
        o, r = _host_counters(store)
        offloaded, restored = offloaded + o, restored + r
    engine.clear_cache()
    leaked_pages = leaked_extents = 0
    pool_pages: dict = {}
    for store in stores:
        store.audit_invariants()
        for kind in store.pool_kinds:
            pool = store.pool(kind)
            leaked_pages += pool.allocated + pool.reserved
            pool_pages[kind.value] = pool_pages.get(kind.value, 0) + pool.capacity
        occupancy = store.host_occupancy()
        if occupancy is not None:
            leaked_extents += int(occupancy.extent_count)
    log = runner.log
    compiles: dict = {}
    for name, n in model_steps.compiles().items():
        unit = name.removesuffix("_state")
        compiles[unit] = compiles.get(unit, 0) + n - compiles_before.get(name, 0)
    compiles = {unit: n for unit, n in compiles.items() if n or unit in log.units}  # steps this run used
    mesh_steps = None
    if config.mesh is not None:
        lanes, slots = runner.lanes, runner.slots
        steps = len(lanes)
        mesh_steps = {
            "steps": steps,
            "lanes_per_step": sum(lanes) / steps if steps else 0.0,
            "max_lanes_per_step": max(lanes, default=0),
            "slots_per_step": sum(slots) / steps if steps else 0.0,
        }
    return Served(records, engine.stats, cache, host_tier, offloaded, restored, dict(peaks), peak_active, peak_host,
                  pool_pages, leaked_pages, leaked_extents, dict(log.units),
                  {k: sorted(v) for k, v in log.buckets.items()}, compiles, mesh_steps)
