"""A data-parallel engine: one :class:`~ninfer_kv.engine.core.EngineCore` per data shard of a
:class:`~ninfer_kv.store.sharded.ShardedKVStore`, their rounds merged into shared mesh steps.

Each data shard has its own engine core (queue, admission, prefix cache, sequences) over its own
store (:class:`ShardStore`: local handles, rows and pages; offloads gather from the sharded state on
the shard's devices).  A request goes to one shard for its whole life (:meth:`DataParallelEngine.add_request`:
the shard holding or computing its longest prefix, else the least loaded one), so its prefixes and
forks never cross shards.

A round runs every shard's round generator (:meth:`EngineCore.round`) in lockstep: when every shard
has yielded a unit or ended, the yielded units of one kind (the lowest shard's) run as *one* step on
the mesh with batch ``D * b`` — shard ``d``'s rows in slots ``[d * b, (d + 1) * b)`` as global rows
``d * C_local + local row``, the other slots the inert row ``C`` — and each shard gets its slice of
the output.  So a round costs as many mesh steps as the busiest shard has units.  The order of
everything is the shards' program order, shards in order between steps: a run is deterministic, and
a request's tokens depend only on its own rows (the same as on one device).

The mesh steps run the main model only (no MTP head); they sample exactly as the one-device steps
do (each request's key folded with the token's position), so seeded requests give the same tokens.  A step that
raises fails the requests of every shard's unit in it; the sharded state is repaired once with
:func:`~ninfer_kv.resync` and every shard gives up what it lost.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..device.allocation import allocate_state
from ..device.offload_gather import offload_checkpoint
from ..device.rounds import take_step_work
from ..device.sharded_store import apply_sharded_work_alone
from ..device.resync import resync
from ..models.decoder.padding import pad_rows
from ..schema.buckets import bucket_for, bucket_ladder
from ..models.decoder.sampling import GREEDY, sampling_rows
from ..store.sharded import ShardedCheckpoint, ShardedKVStore
from .core import EngineCore, EngineStats, request_seed
from .outputs import RequestOutput
from .runner import UnitCall, UnitLog, call_model, consumed
from .sampling_params import SamplingParams

__all__ = ["DataParallelEngine", "MeshRunner", "ShardStore"]


class ShardStore:
    """Data shard ``shard``'s :class:`~ninfer_kv.store.KVStore` as its engine core sees it (every
    verb is the shard's own; the shard's runner offloads from the sharded state)."""

    def __init__(self, sharded: ShardedKVStore, shard: int):
        self._sharded = sharded
        self._store = sharded.store(shard)
        self.shard = shard

    def __getattr__(self, name):
        return getattr(self._store, name)


class MeshRunner:
    """Runs merged units on the one sharded device state (module docstring).

    Args:
      model: the engine's model on the mesh (``DecoderModel(..., mesh=kv_mesh)``); prepared here with
        the global buckets ``D * b``.
      sharded: the sharded store.
      local_buckets: the batch buckets ``b`` of one shard.

    Attributes:
      log: merged steps run, by kind, and their global buckets.
      lanes, slots: real rows and batch slots of every merged step so far.
    """

    def __init__(self, model, sharded: ShardedKVStore, local_buckets: tuple[int, ...]):
        self.model = model
        self.sharded = sharded
        self.local_buckets = tuple(local_buckets)
        d = sharded.num_shards
        model.prepare(sharded.layout("main"), tuple(d * b for b in self.local_buckets))
        self.state = allocate_state(sharded)
        self.log = UnitLog()
        self.lanes: list[int] = []
        self.slots: list[int] = []
        self._lost = {s: (set(), set()) for s in range(d)}

    def run_merged(self, kind: str, calls: list[tuple[int, UnitCall]]) -> list:
        """One mesh step of ``kind`` for ``calls`` (``(shard, call)``, at most one per shard); returns
        each call's slice of the output, in order."""
        sharded = self.sharded
        bucket = bucket_for(max(len(c.rows) for _, c in calls), self.local_buckets)
        total = bucket * sharded.num_shards
        inert = sharded.max_concurrency
        width = calls[0][1].tokens.shape[1]
        tokens = np.zeros((total, width), np.int32)
        pos = np.zeros(total, np.int32)
        valid = np.zeros(total, np.int32)
        table_rows = np.full(total, inert, np.int32)
        configs = [GREEDY] * total
        for shard, c in calls:
            rows = np.asarray(c.rows, np.int64) + shard * sharded.rows_per_shard
            padded = pad_rows(c.tokens, c.positions, c.valid, rows, bucket=bucket, scratch_row=inert)
            lo = shard * bucket
            tokens[lo: lo + bucket], pos[lo: lo + bucket] = padded.tokens, padded.positions
            valid[lo: lo + bucket], table_rows[lo: lo + bucket] = padded.valid, padded.table_rows
            if c.sampling is not None:
                configs[lo: lo + len(c.rows)] = [g if g is not None else GREEDY for g in c.sampling]
        sampling = None
        if any(c.sampling is not None for _, c in calls):
            sampling = sampling_rows(configs, total)
        self.log.record(kind, total)
        self.state, work = take_step_work(sharded, self.state)
        self.state, out = call_model(self.model, kind, self.state, work, tokens, pos, valid, table_rows, sampling, None)
        fields = {f: np.asarray(x) for f, x in out._asdict().items() if x is not None}
        self.lanes.append(sum(len(c.rows) for _, c in calls))
        self.slots.append(total)
        return [out._replace(**{f: x[s * bucket: (s + 1) * bucket] for f, x in fields.items()}) for s, _ in calls]

    def flushed_state(self):
        """The state with every shard's pending round work applied."""
        if any(not p.empty for s in self.sharded.shards for p in s.pending_work().values()):
            self.state = apply_sharded_work_alone(self.sharded, self.state, self.sharded.take_work())
        return self.state

    def repair(self, shard: int) -> tuple[set, set]:
        """Bring the sharded state back in line (once per failure; later calls find it in line) and
        return what ``shard`` lost (local handles)."""
        if consumed(self.state):
            self.state = allocate_state(self.sharded)
        self.state, report = resync(self.sharded, self.state)
        for h in report.lost_sequences:
            self._lost[h.shard][0].add(h.handle)
        for h in report.lost_checkpoints:
            self._lost[h.shard][1].add(h.handle)
        lost = self._lost[shard]
        self._lost[shard] = (set(), set())
        return lost


class _ShardRunner:
    """The runner a shard's core holds: the shared state, and a unit run alone as a merged step."""

    def __init__(self, mesh: MeshRunner, shard: int):
        self.mesh = mesh
        self.shard = shard

    @property
    def state(self):
        return self.mesh.state

    def run(self, call: UnitCall):
        return self.mesh.run_merged(call.kind, [(self.shard, call)])[0]

    def flushed_state(self):
        return self.mesh.flushed_state()

    def offload_checkpoint(self, checkpoint):
        """Move the shard's checkpoint to its Host tier, gathering the pages on the shard's devices."""
        return offload_checkpoint(self.mesh.sharded, ShardedCheckpoint(self.shard, checkpoint), self.mesh.flushed_state())

    def repair(self) -> tuple[set, set]:
        return self.mesh.repair(self.shard)


class DataParallelEngine:
    """Serves requests over a :class:`~ninfer_kv.store.sharded.ShardedKVStore` (module docstring).

    Args:
      model: the model on the mesh (``DecoderModel(params, config, mesh=kv_mesh)``).
      sharded: the sharded store (``max_concurrency`` rows per shard each).
      eos_token_ids, text_state, decode_token, enable_prefix_caching, seed: as :class:`EngineCore`.
    """

    def __init__(self, model, sharded: ShardedKVStore, *, eos_token_ids=(), text_state=None, decode_token=None,
                 enable_prefix_caching: bool = True, seed: int = 0):
        stores = [ShardStore(sharded, d) for d in range(sharded.num_shards)]
        local = bucket_ladder(stores[0].max_concurrency, 2)
        self.runner = MeshRunner(model, sharded, local)
        self.sharded = sharded
        self.cores = [
            EngineCore(model, store, eos_token_ids=eos_token_ids, text_state=text_state, decode_token=decode_token,
                       enable_prefix_caching=enable_prefix_caching, seed=seed, runner=_ShardRunner(self.runner, d))
            for d, store in enumerate(stores)
        ]
        self._shard_of: dict[str, int] = {}
        self.seed = int(seed)
        self._arrivals = 0

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams | None = None, *,
                    prompt: str | None = None):
        """Queue a request on the shard that holds or computes its longest prefix (ties: the one
        with the fewest unfinished requests, then the lowest); checked as
        :meth:`EngineCore.add_request`.  A request without a seed gets the one it would get from a
        single engine with the same seed and arrivals, so its tokens do not depend on the shard."""
        if isinstance(request_id, str) and request_id in self._shard_of:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams) and params.seed is None:
            params = dataclasses.replace(params, seed=request_seed(self.seed, self._arrivals))
        shard = self._route(prompt_token_ids)
        req = self.cores[shard].add_request(request_id, prompt_token_ids, params, prompt=prompt)
        self._shard_of[request_id] = shard
        self._arrivals += 1
        return req

    def _route(self, prompt_token_ids) -> int:
        try:
            ids = self.cores[0]._prompt_ids(prompt_token_ids)
        except (TypeError, ValueError):
            return 0  # the core refuses it with the full message
        limit = ids.size - 1

        def score(d: int):
            core = self.cores[d]
            held = max(core.cache.match(ids, limit)[1], core.pending.longest_match(ids, limit)[1],
                       core.waiting_index.longest_match(ids, limit)[1]) if core.caching and limit > 0 else 0
            return (-held, len(core.requests), d)

        return min(range(len(self.cores)), key=score)

    def abort(self, request_id: str) -> bool:
        """Ask to end a request at the next round boundary (:meth:`EngineCore.abort`)."""
        shard = self._shard_of.get(request_id)
        return False if shard is None else self.cores[shard].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    @property
    def num_running(self) -> int:
        return sum(core.num_running for core in self.cores)

    @property
    def num_waiting(self) -> int:
        return sum(core.num_waiting for core in self.cores)

    # -- the round ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round of every shard in lockstep (module docstring); the changed requests' outputs."""
        gens = {d: core.round() for d, core in enumerate(self.cores)}
        calls: dict[int, UnitCall] = {}
        outputs: list[RequestOutput] = []

        def advance(d: int, value=None, error: Exception | None = None) -> None:
            try:
                calls[d] = gens[d].throw(error) if error is not None else gens[d].send(value)
            except StopIteration as stop:
                outputs.extend(stop.value)

        for d in gens:
            advance(d)
        while calls:
            kind = calls[min(calls)].kind
            batch = [(d, calls.pop(d)) for d in sorted(calls) if calls[d].kind == kind]
            try:
                outs = self.runner.run_merged(kind, batch)
            except Exception as exc:  # noqa: BLE001 - every shard in the step fails that unit's requests
                for d, _ in batch:
                    advance(d, error=exc)
            else:
                for (d, _), out in zip(batch, outs):
                    advance(d, out)
        for out in outputs:
            if out.finished:
                self._shard_of.pop(out.request_id, None)
        return outputs

    # -- statistics ------------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """Every shard's counters summed (``rounds``: the lockstep rounds)."""
        total = EngineStats()
        for core in self.cores:
            for name, value in vars(core.stats).items():
                setattr(total, name, getattr(total, name) + value)
        total.rounds = self.cores[0].stats.rounds
        return total

    def clear_cache(self) -> int:
        """Release every cached prefix no running request uses, on every shard; returns how many."""
        return sum(core.clear_cache() for core in self.cores)
