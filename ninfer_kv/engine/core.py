"""The engine core: a request queue served in rounds over one store, with token-granular prefix reuse.

Each :meth:`EngineCore.step` is one round:

1. **aborts** asked for since the last round take effect: a waiting request leaves the queue, a
   running one finishes (its committed prefix is kept in the prefix cache);
2. **admission**, in arrival order: a request starts only when the store can reserve its whole
   budget (prompt + max tokens) for each of its ``n`` completions — evicting cached prefixes as
   needed — so every admitted request completes; the first request that does not fit waits, and so
   do those behind it (no overtaking, no starvation).  A request forks its longest cached prefix
   (at most ``prompt - 1`` tokens, at any token: full pages shared, the partial tail copied).
   Before that, a prefix that waiting requests share beyond what the cache holds (at least
   :data:`MIN_SHARED_TOKENS` tokens more), and the prompt of an ``n > 1`` request, is first
   prefilled once by a *prefix job* and retained, and the requests then fork it;
3. **prefill and decode in one ragged batch** (a model with a ``ragged`` call whose ops have native
   ragged kernels, no speculation — :func:`~ninfer_kv.engine.model.feeds_ragged_rounds` — on a
   runner that runs it): every decoding sequence feeds its one token and the sequences still in
   their prompts, in arrival order, as many prompt tokens as the round's budget
   ``max_num_batched_tokens`` leaves, all in one model call where each row pays for its own tokens
   only; a round with no prompt work is a plain decode step.  Otherwise (speculative models,
   data-parallel engines, an ``impl`` without native ragged kernels, which would read a row's keys
   once per prompt token) **prefill**: every sequence still in its prompt gets one chunk of
   ``prefill_chunk`` tokens (batched, padded to a bucket), then **decode**.  A sequence whose
   prompt completes produces its first token;
4. **decode**: every other running sequence produces one token (batched); with lease growth
   (``KVStore(..., entitlement=EntitlementPolicy(kv_lease_growth=True))``) the decoding sequences'
   entitlements are extended first (:meth:`~ninfer_kv.store.KVStore.round_boundary`), and one the
   pool cannot extend, even after evicting cached prefixes, ends with ``"length"``;
5. **finish**: ended sequences are released, or retained and indexed in the prefix cache; ended
   prefix jobs are retained and indexed (their waiting requests are admitted next round).

Every unit follows the store's protocol: ``map`` -> ``take_step_work`` -> one step (the work
applied inside it) -> ``commit``.  An exception inside a step fails only the requests of that
step: their sequences are finished, the device state is repaired with :func:`~ninfer_kv.resync`
(a fresh blank state when the failed step consumed it) and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Sequence as Seq

import numpy as np

from ..schema.errors import PoolCapacityError
from ..schema.geometry import PAGE_SIZE
from ..schema.buckets import bucket_ladder, resolve_max_num_batched_tokens, token_ladder
from ..models.request_checks import token_ids
from ..schema.kinds import PoolKind
from ..store import KVStore
from .model import EngineModel, draft_window_of, feeds_ragged_rounds
from .outputs import FINISH_ABORT, FINISH_LENGTH, RequestOutput
from .prefix_cache import PrefixCache
from .prefix_index import PrefixIndex
from .requests import FINISHED, JOB, RUNNING, WAITING, PrefixJob, Request, Sequence
from ..device.ring_snapshots import RingImage, RingSnapshots
from .runner import DeviceRunner, UnitCall, drive
from .sampling_params import SamplingParams
from .speculative import HiddenStates, pending_pairs

__all__ = ["EngineCore", "EngineStats", "MIN_SHARED_TOKENS", "request_seed"]

MIN_SHARED_TOKENS = PAGE_SIZE
"""Tokens that waiting requests must share beyond the cached prefix before a prefix job computes
them once (below that, each request prefills them itself)."""


@dataclasses.dataclass
class EngineStats:
    """Counters of an engine.

    Attributes:
      rounds: calls of :meth:`EngineCore.step`; prefill_units / decode_units / ragged_units: model
        steps run (a speculative round counts as one decode unit; a ragged round as one ragged unit).
      prefill_tokens / decode_tokens: tokens they processed (padding excluded; decode: tokens produced).
      prefix_jobs: prefixes computed once for several sequences.
      failed_steps: steps that raised (their requests failed, the state was repaired).
      admission_waits: rounds in which a request waited for pages or rows.
      bounded_completions: sequences ended with ``"length"`` because the pool could not extend
        their lease (lease growth only); lease_pages_granted: pages those leases grew by.
      spec_rounds: sequence-rounds of speculative decoding; drafts_verified / drafts_accepted: the
        drafts verified and accepted in them.
    """

    rounds: int = 0
    prefill_units: int = 0
    decode_units: int = 0
    ragged_units: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_jobs: int = 0
    failed_steps: int = 0
    admission_waits: int = 0
    bounded_completions: int = 0
    lease_pages_granted: int = 0
    spec_rounds: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0


class EngineCore:
    """Serves requests over one :class:`~ninfer_kv.store.KVStore` and an :class:`EngineModel`.

    Args:
      model: the model (its steps are prepared for the store's profile and the batch buckets here).
      store: a store over ``model.kv_config(profile)`` (Main pool; an optional Host tier).
      eos_token_ids: ids that end a completion unless ``ignore_eos``.
      text_state: ``text_state(prompt_ids, params) -> state`` with ``push(token)``, ``stopped`` and
        ``output(final)`` (the completion's text and stop strings), or ``None`` to serve token ids only.
      decode_token: ``decode_token(id) -> str`` for log-probability entries (``None``: no text).
      enable_prefix_caching: keep finished sequences' KV and reuse it.
      seed: the engine seed, from which requests without a seed draw theirs.
      runner: what runs the units (default: a :class:`~ninfer_kv.engine.runner.DeviceRunner` on one
        device; a data-parallel engine passes its shard's).
      max_num_batched_tokens: tokens a ragged round feeds at most (>= the store's rows; ``None``:
        :data:`~ninfer_kv.schema.buckets.DEFAULT_MAX_NUM_BATCHED_TOKENS`, or the rows when more,
        :func:`~ninfer_kv.schema.buckets.resolve_max_num_batched_tokens`); ragged rounds need a model that
        :func:`~ninfer_kv.engine.model.feeds_ragged_rounds` accepts (a ``ragged`` call on native ragged
        kernels, no speculation) and a runner that runs them.

    Attributes:
      ragged_rounds: whether rounds run as one ragged unit (else rectangular prefill and decode units).

    A model with a ``draft_window`` (an MTP head; :mod:`ninfer_kv.engine.speculative`) over a store
    with an MTP pool decodes in speculative rounds.
    """

    def __init__(
        self,
        model: EngineModel,
        store: KVStore,
        *,
        eos_token_ids: Seq[int] = (),
        text_state: Callable | None = None,
        decode_token: Callable[[int], str] | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        runner=None,
        max_num_batched_tokens: int | None = None,
    ):
        self.model = model
        self.store = store
        self.max_model_len = store.max_context
        self.max_num_seqs = store.max_concurrency
        self.buckets = bucket_ladder(self.max_num_seqs, 2)
        self.draft_window = draft_window_of(model)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(max_num_batched_tokens, self.max_num_seqs)
        has_mtp = PoolKind.MTP in store.pool_kinds
        if has_mtp != bool(self.draft_window):
            raise ValueError("the store has an MTP pool but the model has no MTP head (draft_window)" if has_mtp else
                             f"the model drafts {self.draft_window} tokens per round but the store has no MTP pool; "
                             "plan it with SpeculativeConfig('mtp', draft_window=K)")
        if self.draft_window and store.policy.kv_lease_growth and store.policy.cushion_tokens < self.draft_window + 1:
            raise ValueError(f"lease growth with draft_window={self.draft_window} needs cushion_tokens >= "
                             f"{self.draft_window + 1} (a round writes up to K + 1 tokens); got "
                             f"{store.policy.cushion_tokens}")
        # Ragged rounds need both sides: a model that runs them natively (feeds_ragged_rounds: a
        # ragged call, no speculation, native ragged kernels under its impl) and a runner that runs
        # ragged units (a mesh runner does not).  Otherwise rounds are rectangular units.
        ragged = feeds_ragged_rounds(model)
        if runner is None:
            tokens = token_ladder(self.max_num_batched_tokens) if ragged else None
            runner = DeviceRunner(model, store, self.buckets, token_buckets=tokens)
        self.runner = runner
        self.ragged_rounds = ragged and bool(getattr(runner, "runs_ragged", False))
        self.chunk = int(model.prefill_chunk)
        if self.chunk < PAGE_SIZE or self.chunk % PAGE_SIZE:
            raise ValueError(f"the model's prefill_chunk={self.chunk} must be a positive multiple of {PAGE_SIZE}")
        # window rings hold a row's window plus one step: no row writes more than step_tokens per unit
        rings = store.pool_set.rings
        self.row_tokens = rings.spec.step_tokens if rings is not None else self.max_num_batched_tokens
        if rings is not None and self.chunk > self.row_tokens:
            raise ValueError(f"the model's prefill_chunk={self.chunk} exceeds the window rings' step_tokens="
                             f"{self.row_tokens}; plan the rings with step_tokens >= the prefill chunk")
        self.vocab_size = int(model.vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text_state = text_state
        self.decode_token = decode_token
        # Window rings belong to an execution row and are overwritten by its next sequence: a ring
        # model's retained checkpoints keep a snapshot of the ring (ring_snapshots), and without
        # snapshot slots it neither reuses prefixes nor forks (n > 1 completions prefill each).
        copy = getattr(self.runner, "copy_ring", None)
        self.ring_snapshots = RingSnapshots(rings, copy) if rings is not None and rings.spec.snapshots and copy else None
        self.forks = rings is None or self.ring_snapshots is not None
        self.caching = bool(enable_prefix_caching) and self.forks
        self.seed = int(seed)
        self.cache = PrefixCache(store, self.runner.offload_checkpoint, release=self._release_checkpoint)
        self.pending = PrefixIndex()  # prefixes being computed by jobs
        self.waiting_index = PrefixIndex()  # prompts of waiting requests (for shared-prefix jobs)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Sequence] = []
        self.jobs: list[PrefixJob] = []
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._aborts: list[str] = []
        self._changed: dict[str, Request] = {}
        self._waiting_entries: dict[int, object] = {}

    # -- requests ---------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams | None = None,
                    *, prompt: str | None = None) -> Request:
        """Queue a request; every argument is checked first (``ValueError`` / ``TypeError`` naming the
        value), and a refused request changes nothing.  The next :meth:`step` returns its first
        output (no tokens yet), so a caller learns at once that it was queued."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt_token_ids)
        if ids.size >= self.max_model_len:
            raise ValueError(f"the prompt has {ids.size} tokens; max_model_len={self.max_model_len} leaves no room to "
                             f"generate (allowed: at most {self.max_model_len - 1} prompt tokens)")
        token_ids("stop_token_ids", params.stop_token_ids or (), self.vocab_size)
        room = self.max_model_len - ids.size
        budget = room if params.max_tokens is None else min(int(params.max_tokens), room)
        self._check_fits(ids.size, budget, params.n)
        arrival = next(self._arrivals)
        base = params.seed if params.seed is not None else request_seed(self.seed, arrival)
        seeds = tuple(base if i == 0 else _mix(base, i) for i in range(params.n))
        req = Request(request_id, prompt, ids, params, budget, frozenset(params.stop_token_ids or ()),
                      frozenset() if params.ignore_eos else self.eos_token_ids, seeds, arrival)
        self.requests[request_id] = req
        self.waiting.append(req)
        self._index_waiting(req)
        self._changed[request_id] = req  # the next round reports it queued (an output with no tokens yet)
        return req

    def _check_fits(self, prompt: int, budget: int, n: int) -> None:
        """Refuse a request no admission could ever start, even in an idle engine with an empty cache:
        more completions than rows, or more pages than the Main pool holds for its ``n`` reservations
        (each whole, or forking its prompt's full pages from a prefix job's checkpoint)."""
        if n > self.max_num_seqs:
            raise ValueError(f"n={n} completions run at once, one row each; max_num_seqs={self.max_num_seqs} "
                             f"(allowed: n <= {self.max_num_seqs})")
        tokens = prompt + budget
        if self.store.policy.kv_lease_growth:  # an activation leases the prompt and a cushion at least
            tokens = min(tokens, prompt + self.store.policy.cushion_tokens)
        whole = -(-tokens // PAGE_SIZE)
        need = n * whole
        if n > 1:  # the prompt's checkpoint, then n forks sharing its full pages
            need = min(need, -(-(prompt - 1) // PAGE_SIZE) + n * (whole - (prompt - 1) // PAGE_SIZE))
        capacity = self.store.pool("main").capacity
        if need > capacity:
            raise ValueError(f"the request needs {need} pages of {PAGE_SIZE} tokens (n={n} x {prompt} prompt + "
                             f"{budget} max tokens) but the Main pool holds {capacity}; lower max_tokens or n")

    def _prompt_ids(self, prompt_token_ids) -> np.ndarray:
        ids = token_ids("prompt_token_ids", prompt_token_ids, self.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty; it must hold at least one token")
        out = np.asarray(ids, np.int32)
        out.flags.writeable = False
        return out

    def abort(self, request_id: str) -> bool:
        """Ask to end a request at the next round boundary (its row and reservation are freed then and
        its committed prefix stays cacheable); ``False`` when no unfinished request has that id."""
        req = self.requests.get(request_id)
        if req is None or req.aborted:
            return False
        req.aborted = True
        self._aborts.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        """Requests in the queue."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests with running sequences."""
        return sum(1 for r in self.requests.values() if r.status == RUNNING)

    # -- the round ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round (module docstring); returns the outputs of the requests that changed, finished
        ones included (each returned once finished, then forgotten)."""
        return drive(self.round(), self.runner.run)

    def round(self):
        """The round as a generator: yields each :class:`~ninfer_kv.engine.runner.UnitCall`, is sent
        the model's output (or thrown the step's exception), and returns what :meth:`step` returns.
        :meth:`step` drives it on this engine's runner; a data-parallel engine drives the rounds of
        its shards together, merging their units into shared steps."""
        self.stats.rounds += 1
        self._apply_aborts()
        self._admit()
        pre = [s for s in self.running if s.prefilling]
        if self.ragged_rounds and pre:
            dec = [s for s in self.running if not s.prefilling and not s.done and s.request is not None]
            self._limits(dec)
            yield from self._ragged(dec, pre)
            self._finish_done()
            return self._outputs()
        for group in _groups(pre, self.buckets[-1]):
            yield from self._prefill(group)
        prefilled = {id(s) for s in pre}  # a sequence whose prompt completed this round has its token
        dec = [s for s in self.running if not s.prefilling and not s.done and id(s) not in prefilled
               and s.request is not None]
        limits = self._limits(dec)
        for group in _groups(list(zip(dec, limits)), self.buckets[-1]):
            seqs = [s for s, _ in group]
            if self.draft_window:
                yield from self._speculate(seqs, [lim for _, lim in group])
            else:
                yield from self._decode(seqs)
        self._finish_done()
        return self._outputs()

    def _limits(self, seqs: list[Sequence]) -> list[int]:
        """Tokens each decoding sequence may produce this round (``K + 1`` in a speculative round,
        else 1, within its budget).  With lease growth the entitlements are extended first
        (:meth:`~ninfer_kv.store.KVStore.round_boundary`), evicting cached prefixes while some
        sequence's lease cannot cover its next token; one the pool still cannot extend ends with
        finish reason ``"length"`` at its committed frontier (bounded completion) and leaves the list."""
        per_round = self.draft_window + 1 if self.draft_window else 1
        limits = [min(per_round, s.request.budget - len(s.generated)) for s in seqs]
        if not seqs or not self.store.policy.kv_lease_growth:
            return limits
        rows = np.array([s.row for s in seqs], np.int64)
        front = np.array([s.frontier for s in seqs], np.int64)
        while True:
            grant = self.store.round_boundary(rows)
            self.stats.lease_pages_granted += int(np.sum(grant.granted_pages[PoolKind.MAIN]))
            if not grant.length_limited.any() or not self.cache.evict_one():
                break
        room = grant.covered_tokens - front
        keep, kept_limits = [], []
        for s, lim, r, short in zip(seqs, limits, room.tolist(), grant.length_limited.tolist()):
            if short or r < 1:
                s.finish_reason = FINISH_LENGTH
                self.stats.bounded_completions += 1
                self._changed[s.request.request_id] = s.request
            else:
                keep.append(s)
                kept_limits.append(int(min(lim, r)))
        seqs[:] = keep
        return kept_limits

    def _outputs(self) -> list[RequestOutput]:
        out = []
        for rid, req in self._changed.items():
            out.append(req.output())
            if req.status == FINISHED:
                self.requests.pop(rid, None)
        self._changed = {}
        return out

    # -- aborts ----------------------------------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        for rid in self._aborts:
            req = self.requests.get(rid)
            if req is None or req.status == FINISHED:
                continue
            for seq in req.sequences:
                if seq is not None and seq.finish_reason is None:
                    seq.finish_reason = FINISH_ABORT
            self._end_request(req)
        self._aborts = []

    # -- admission -----------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        for req in list(self.waiting):
            verdict = self._try_admit(req)
            if verdict == "blocked":
                self.stats.admission_waits += 1
                break

    def _free_rows(self) -> int:
        return self.max_num_seqs - len(self.running)

    def _try_admit(self, req: Request) -> str:
        """``"admitted"``, ``"waiting"`` (on a prefix job; later requests may go first) or ``"blocked"``."""
        prompt = req.prompt_ids
        limit = prompt.size - 1
        if req.status == JOB:
            return "waiting"
        if req.private_source is not None:
            return self._start(req, None, req.private_source[1], checkpoint=req.private_source[0])
        entry, m = self.cache.match(prompt, limit) if self.caching else (None, 0)
        if entry is not None and not self._resumable(entry.value, m):
            entry, m = None, 0  # a ring model's snapshot does not reach back to m (ring_snapshots)
        if self.caching:
            _, pm = self.pending.longest_match(prompt, limit)
            if pm > m:
                return "waiting"
            self._unindex_waiting(req)
            _, shared = self.waiting_index.longest_match(prompt, limit)
            self._index_waiting(req)
            if shared >= m + MIN_SHARED_TOKENS:
                return self._start_job(prompt[:shared], entry, m, owner=None)
        if req.params.n > 1 and m < limit and self.forks and req.fork:
            return self._start_job(prompt[:limit], entry, m, owner=None if self.caching else req)
        return self._start(req, entry, m)

    def _start(self, req: Request, entry, m: int, *, checkpoint=None) -> str:
        n = req.params.n
        if self._free_rows() < n:
            return "blocked"
        source = checkpoint if checkpoint is not None else (entry.value if entry is not None else None)
        handles = []
        try:
            for _ in range(n):
                handles.append(self._activate(req.prompt_ids.size, req.budget, source, m if source is not None else 0,
                                              entry))
        except PoolCapacityError:
            for h in handles:
                self.store.finish(h)
            if source is not None and not self.running:
                # nothing runs, so nothing will free pages: the source itself is in the way (it cannot
                # be evicted while forked); start from the root instead
                if checkpoint is not None:
                    self._release_checkpoint(checkpoint)
                    req.private_source = None
                return self._start(req, None, 0)
            return "blocked"
        self._unqueue(req)
        req.status = RUNNING
        start = m if source is not None else 0
        req.num_cached_tokens = m if entry is not None else 0
        if entry is not None:
            self.cache.stats.hits += 1
            self.cache.stats.hit_tokens += m
        for i, h in enumerate(handles):
            seq = Sequence(h, self.store.row(h), [int(t) for t in req.prompt_ids], req.prompt_ids.size, start,
                           request=req, index=i,
                           sampling=req.params.sampling_config(req.seeds[i], index=i), source=entry)
            if entry is not None:
                self.cache.index.pin(entry)
                self.cache.index.touch(entry, self.stats.rounds)
            if self.draft_window:
                held = req.private_source[2] if checkpoint is not None else self.cache.hidden_of(entry)
                self._resume_mtp(seq, held, start)
            if self.text_state is not None:
                seq.text = self.text_state(req.prompt_ids, req.params)
            if req.params.logprobs is not None:
                seq.logprobs = []
            req.sequences.append(seq)
            self.running.append(seq)
        if checkpoint is not None:  # a private prefix job's checkpoint: every completion forked it
            self._release_checkpoint(checkpoint)
            req.private_source = None
        self._changed[req.request_id] = req
        return "admitted"

    def _start_job(self, tokens: np.ndarray, entry, m: int, owner: Request | None) -> str:
        if self._free_rows() < 1:
            return "blocked"
        source = entry.value if entry is not None else None
        try:
            handle = self._activate(tokens.size, 0, source, m, entry)
        except PoolCapacityError:
            if source is not None and not self.running:  # as in _start: the source is in the way
                return self._start_job(tokens, None, 0, owner)
            return "blocked"
        job = PrefixJob(np.array(tokens, np.int32), owner=owner)
        seq = Sequence(handle, self.store.row(handle), [int(t) for t in tokens], tokens.size, m if source else 0,
                       job=job, source=entry)
        if entry is not None:
            self.cache.index.pin(entry)
            self.cache.index.touch(entry, self.stats.rounds)
        self._resume_mtp(seq, self.cache.hidden_of(entry), seq.frontier)
        job.sequence = seq
        if owner is None:
            job.entry = self.pending.insert(job.tokens, job, now=self.stats.rounds)
        else:
            owner.status = JOB  # waits for its private prefix
        self.jobs.append(job)
        self.running.append(seq)
        self.stats.prefix_jobs += 1
        return "waiting"

    def _resume_mtp(self, seq: Sequence, held, start: int) -> None:
        """A speculative engine's sequence starts with the hidden states ``held[:start]`` of the
        tokens it forked (from a cache entry or a private checkpoint) at the MTP frontier the store
        continued it at."""
        if not self.draft_window:
            return
        d = self.model.hidden_size
        if start == 0:
            seq.hidden, seq.mtp_frontier = HiddenStates(d), 0
            return
        seq.hidden = HiddenStates(d, held[:start])
        seq.mtp_frontier = self.store.address_space(seq.handle, PoolKind.MTP).committed_frontier

    def _activate(self, prompt: int, budget: int, source, m: int, entry):
        """``store.activate``, evicting cached prefixes (never ``entry``) while the pool lacks pages."""
        while True:
            try:
                if source is None:
                    return self.store.activate(prompt, budget)
                handle = self.store.activate(prompt, budget, source=source, source_tokens=m)
                if self.ring_snapshots is not None:  # the ring layers resume from the checkpoint's snapshot
                    self.ring_snapshots.restore(self.store.checkpoint(source).state_image, self.store.row(handle))
                return handle
            except PoolCapacityError:
                if not self.cache.evict_one(exclude=entry):
                    raise

    # -- units ------------------------------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence]):
        """One prefill chunk for every sequence of ``seqs``; one whose prompt completes produces its
        first token.  With a speculative model the MTP pool then catches up."""
        n, t = len(seqs), self.chunk
        tokens = np.zeros((n, t), np.int32)
        pos = np.zeros(n, np.int32)
        valid = np.zeros(n, np.int32)
        for i, s in enumerate(seqs):
            v = min(t, s.target - s.frontier)
            tokens[i, :v] = s.tokens[s.frontier: s.frontier + v]
            pos[i], valid[i] = s.frontier, v
        rows = np.array([s.row for s in seqs], np.int64)
        ends = pos.astype(np.int64) + valid
        self.store.map(rows, ends)
        try:
            out = yield UnitCall("prefill", tokens, pos, valid, rows, _sampling(seqs))
            chosen = np.asarray(out.next_tokens)[:n]
            hidden = np.asarray(out.hidden, np.float32) if self.draft_window else None
        except Exception as exc:  # noqa: BLE001 - a failed step fails its own requests only
            self._fail_unit(seqs, exc)
            return
        self.store.commit(rows, ends)
        self.stats.prefill_units += 1
        self.stats.prefill_tokens += int(valid.sum())
        want = [i for i, s in enumerate(seqs) if s.logprobs is not None and int(ends[i]) >= s.target]
        logits = np.asarray(out.logits[:n]) if want else None
        for i, s in enumerate(seqs):
            s.frontier = int(ends[i])
            if hidden is not None:
                s.hidden.extend(hidden[i, : valid[i]])
            if s.request is None or s.prefilling:
                continue
            self._produce(s, int(chosen[i]), logits[i] if s.logprobs is not None else None)
        if self.draft_window:
            yield from self._extend_mtp(seqs)

    def _ragged(self, dec: list[Sequence], pre: list[Sequence]):
        """One ragged unit: a token for every sequence of ``dec``, then prompt tokens of ``pre`` in
        arrival order within the round's budget; a sequence whose prompt completes produces its first
        token."""
        budget = self.max_num_batched_tokens - len(dec)
        chunks = []
        for s in pre:
            if budget <= 0:
                break
            v = min(s.target - s.frontier, budget, self.row_tokens)
            chunks.append((s, v))
            budget -= v
        seqs = dec + [s for s, _ in chunks]
        valid = np.array([1] * len(dec) + [v for _, v in chunks], np.int32)
        tokens = np.array([s.tokens[-1] for s in dec] + [t for s, v in chunks for t in s.tokens[s.frontier:s.frontier + v]],
                          np.int32)
        pos = np.array([s.frontier for s in seqs], np.int32)
        rows = np.array([s.row for s in seqs], np.int64)
        ends = pos.astype(np.int64) + valid
        n = len(seqs)
        self.store.map(rows, ends)
        try:
            out = yield UnitCall("ragged", tokens, pos, valid, rows, _sampling(seqs))
            chosen = np.asarray(out.next_tokens)[:n]
        except Exception as exc:  # noqa: BLE001 - a failed step fails its own requests only
            self._fail_unit(seqs, exc)
            return
        self.store.commit(rows, ends)
        self.stats.ragged_units += 1
        self.stats.decode_tokens += len(dec)
        self.stats.prefill_tokens += int(valid[len(dec):].sum())
        producing = [s.request is not None and int(ends[i]) >= s.target for i, s in enumerate(seqs)]
        want = any(p and s.logprobs is not None for p, s in zip(producing, seqs))
        logits = np.asarray(out.logits[:n]) if want else None
        for i, s in enumerate(seqs):
            s.frontier = int(ends[i])
            if producing[i]:
                self._produce(s, int(chosen[i]), logits[i] if s.logprobs is not None else None)

    def _decode(self, seqs: list[Sequence]):
        """One token for every sequence of ``seqs``."""
        n = len(seqs)
        tokens = np.array([[s.tokens[-1]] for s in seqs], np.int32)
        pos = np.array([s.frontier for s in seqs], np.int32)
        valid = np.ones(n, np.int32)
        rows = np.array([s.row for s in seqs], np.int64)
        ends = pos.astype(np.int64) + 1
        self.store.map(rows, ends)
        try:
            out = yield UnitCall("decode", tokens, pos, valid, rows, _sampling(seqs))
            chosen = np.asarray(out.next_tokens)[:n]
        except Exception as exc:  # noqa: BLE001
            self._fail_unit(seqs, exc)
            return
        self.store.commit(rows, ends)
        self.stats.decode_units += 1
        self.stats.decode_tokens += n
        logits = np.asarray(out.logits[:n]) if any(s.logprobs is not None for s in seqs) else None
        for i, s in enumerate(seqs):
            s.frontier = int(ends[i])
            self._produce(s, int(chosen[i]), logits[i] if s.logprobs is not None else None)

    def _produce(self, s: Sequence, token: int, logits) -> None:
        if logits is not None:
            s.record_logprobs(token, logits, s.request.params.logprobs, self.decode_token or _no_text)
        s.append(token)
        self._changed[s.request.request_id] = s.request

    def _extend_mtp(self, seqs: list[Sequence]):
        """Write every pending MTP pair of ``seqs`` (``mtp_extend``, a chunk at a time)."""
        t, d = self.chunk, self.model.hidden_size
        while True:
            todo = []
            for s in seqs:
                if s.handle is None or s not in self.running:
                    continue
                c = pending_pairs(s.frontier, len(s.tokens), s.mtp_frontier,
                                  keep_last=s.request is not None and not s.prefilling)
                if c:
                    todo.append((s, min(c, t)))
            if not todo:
                return
            n = len(todo)
            hidden = np.zeros((n, t, d), np.float32)
            nxt = np.zeros((n, t), np.int32)
            pos = np.zeros(n, np.int32)
            valid = np.zeros(n, np.int32)
            for i, (s, c) in enumerate(todo):
                hidden[i, :c] = s.hidden.window(s.mtp_frontier, s.mtp_frontier + c)
                nxt[i, :c] = s.tokens[s.mtp_frontier + 1: s.mtp_frontier + 1 + c]
                pos[i], valid[i] = s.mtp_frontier, c
            rows = np.array([s.row for s, _ in todo], np.int64)
            ends = pos.astype(np.int64) + valid
            self.store.map(rows, ends, pool=PoolKind.MTP)
            try:
                yield UnitCall("mtp_extend", nxt, pos, valid, rows, None, hidden)
            except Exception as exc:  # noqa: BLE001
                self._fail_unit([s for s, _ in todo], exc)
                return
            self.store.commit(rows, ends, pool=PoolKind.MTP)
            for s, c in todo:
                s.mtp_frontier += c

    def _speculate(self, seqs: list[Sequence], limits: list[int]):
        """One MTP round per sequence: draft ``K`` tokens, verify ``min(K + 1, limit)`` of them, settle
        both pools (:mod:`ninfer_kv.engine.speculative`)."""
        k, d = self.draft_window, self.model.hidden_size
        n = len(seqs)
        rows = np.array([s.row for s in seqs], np.int64)
        hidden = np.zeros((n, k + 1, d), np.float32)
        nxt = np.zeros((n, k + 1), np.int32)
        mpos = np.zeros(n, np.int32)
        mvalid = np.zeros(n, np.int32)
        for i, s in enumerate(seqs):
            c = s.frontier - s.mtp_frontier
            if not 1 <= c <= k + 1 or len(s.tokens) != s.frontier + 1:
                raise AssertionError(f"sequence of {s.request.request_id!r}: {c} pending MTP pairs, expected 1..{k + 1}")
            hidden[i, :c] = s.hidden.window(s.mtp_frontier, s.frontier)
            nxt[i, :c] = s.tokens[s.mtp_frontier + 1: s.frontier + 1]
            mpos[i], mvalid[i] = s.mtp_frontier, c
        front = np.array([s.frontier for s in seqs], np.int64)
        self.store.map(rows, front + (k - 1), pool=PoolKind.MTP)  # the provisional lead of K - 1 drafts
        try:
            drafted = yield UnitCall("mtp_draft", nxt, mpos, mvalid, rows, None, hidden)
            drafts = np.asarray(drafted)[:n]
        except Exception as exc:  # noqa: BLE001
            self._fail_unit(seqs, exc)
            return
        self.store.commit(rows, front, pool=PoolKind.MTP)  # the extended pairs are canonical
        tokens = np.zeros((n, k + 1), np.int32)
        vvalid = np.array(limits, np.int32)
        for i, s in enumerate(seqs):
            tokens[i, 0] = s.tokens[-1]
            tokens[i, 1:] = drafts[i]
        self.store.map(rows, front + vvalid)
        try:
            out = yield UnitCall("verify", tokens, front.astype(np.int32), vvalid, rows, _sampling(seqs))
            accepted = np.asarray(out.num_accepted)[:n].astype(np.int64)
            target = np.asarray(out.target_tokens)[:n]
            vhidden = np.asarray(out.hidden, np.float32)[:n]
            logits = np.asarray(out.logits[:n]) if any(s.logprobs is not None for s in seqs) else None
        except Exception as exc:  # noqa: BLE001
            self._fail_unit(seqs, exc)
            return
        kept = np.zeros(n, np.int64)
        for i, s in enumerate(seqs):
            for j in range(int(accepted[i]) + 1):  # the accepted drafts, then the bonus token
                self._produce(s, int(target[i, j]), logits[i, j] if s.logprobs is not None else None)
                kept[i] += 1
                if s.finish_reason is not None:  # nothing after a stop
                    break
        self.store.settle(rows, front + kept)
        self.store.settle(rows, front, pool=PoolKind.MTP)
        for i, s in enumerate(seqs):
            s.hidden.extend(vhidden[i, : kept[i]])  # h_n .. : the next round's pending pairs
            s.mtp_frontier = int(front[i])
            s.frontier = int(front[i] + kept[i])
        st = self.stats
        st.decode_units += 1
        st.spec_rounds += n
        st.drafts_verified += int((vvalid - 1).sum())
        st.drafts_accepted += int(np.minimum(accepted, kept - 1).sum())
        st.decode_tokens += int(kept.sum())

    def _fail_unit(self, seqs: list[Sequence], exc: Exception) -> None:
        """A step raised: fail its requests, repair the device state, keep the store consistent."""
        self.stats.failed_steps += 1
        failed = {id(s.request): s.request for s in seqs if s.request is not None}
        for s in seqs:
            if s.request is None:  # a prefix job: its waiters prefill themselves
                self._drop_job(s.job)
        for req in failed.values():
            req.error = exc
            for s in req.sequences:
                if s is not None and s.finish_reason is None:
                    s.finish_reason = FINISH_ABORT
            self._end_request(req, retain=False)
        self._handle_lost(*self.runner.repair())

    def _handle_lost(self, lost_seq: set, lost_ckpt: set) -> None:
        """Requests and cache entries whose content a repair could not restore are given up."""
        for s in list(self.running):
            if s.handle in lost_seq:
                if s.request is not None:
                    req = s.request
                    req.error = req.error or RuntimeError("the device lost this request's KV content")
                    for o in req.sequences:
                        if o is not None and o.finish_reason is None:
                            o.finish_reason = FINISH_ABORT
                    self._end_request(req, retain=False)
                else:
                    self._drop_job(s.job)
        for entry in list(self.cache.index):
            if entry.value in lost_ckpt:
                for s in self.running:  # forks still running keep their own pages; the entry goes
                    if s.source is entry:
                        s.source = None
                        self.cache.index.unpin(entry)
                self.cache.forget(entry)
                self._release_checkpoint(entry.value)

    # -- finishing ----------------------------------------------------------------------------------------------------
    def _finish_done(self) -> None:
        for s in [s for s in self.running if s.done]:
            if s.job is not None:
                self._complete_job(s.job)
            elif s.request is not None and all(o is not None and o.done for o in s.request.sequences) \
                    and len(s.request.sequences) == s.request.params.n:
                self._end_request(s.request)

    def _leave(self, s: Sequence) -> None:
        """Take ``s`` off the running list and unpin the cache entry it forked."""
        self.running.remove(s)
        if s.source is not None:
            self.cache.index.unpin(s.source)

    def _release_sequence(self, s: Sequence, retain: bool) -> None:
        """End ``s`` in the store: retained and indexed (its committed tokens) or released."""
        self._leave(s)
        if retain and self.caching and s.frontier > 0:
            ckpt = self._retain(s)  # the sequence ends either way; None: it could not be retained
            if ckpt is not None:
                self.cache.keep(np.asarray(s.tokens[: s.frontier], np.int32), ckpt, self.stats.rounds,
                                hidden=self._hidden_kept(s))
        else:
            self.store.finish(s.handle)

    def _end_request(self, req: Request, retain: bool = True) -> None:
        for s in req.sequences:
            if s is not None and s in self.running:
                self._release_sequence(s, retain)
        if req.status in (WAITING, JOB):
            self._unqueue(req)
        if req.private_source is not None:
            self._release_checkpoint(req.private_source[0])
            req.private_source = None
        req.status = FINISHED
        self._changed[req.request_id] = req

    def _complete_job(self, job: PrefixJob) -> None:
        s = job.sequence
        self._leave(s)
        if job.entry is not None:
            self.pending.remove(job.entry)
        self.jobs.remove(job)
        ckpt = self._retain(s)
        if ckpt is None:  # no ring snapshot slot: the owner prefills on its own, waiting requests start anew
            if job.owner is not None and job.owner.status != FINISHED:
                job.owner.fork = False
                job.owner.status = WAITING
            return
        if job.owner is not None:
            if job.owner.status == FINISHED:  # aborted meanwhile
                self._release_checkpoint(ckpt)
            else:
                job.owner.private_source = (ckpt, int(job.tokens.size), self._hidden_kept(s))
                job.owner.status = WAITING
        else:
            self.cache.keep(job.tokens, ckpt, self.stats.rounds, hidden=self._hidden_kept(s))

    def _retain(self, s: Sequence):
        """End ``s`` retained: its checkpoint (with a ring model, holding a snapshot of the row's
        ring, taking the slot of the least recently used cached entry when none is free), or ``None``
        when a ring model finds no slot it can take (``s`` then ends released)."""
        if self.ring_snapshots is None:
            return self.store.finish(s.handle, retain=True)
        image = self.ring_snapshots.capture(s.row, s.frontier)
        if image is None and self.cache.release_lru(lambda e: self._snapshot_of(e.value) is not None):
            image = self.ring_snapshots.capture(s.row, s.frontier)
        if image is None:
            self.store.finish(s.handle)
            return None
        return self.store.finish(s.handle, retain=True, state_image=image)

    def _snapshot_of(self, checkpoint):
        """The :class:`~ninfer_kv.device.ring_snapshots.RingImage` a checkpoint holds, or ``None``."""
        image = self.store.checkpoint(checkpoint).state_image
        return image if isinstance(image, RingImage) else None

    def _resumable(self, checkpoint, m: int) -> bool:
        """Whether a sequence may resume from ``checkpoint`` at ``m`` tokens: always without window
        rings, else where its ring snapshot reaches (:mod:`ninfer_kv.device.ring_snapshots`)."""
        return self.ring_snapshots is None or self.ring_snapshots.resumable(self._snapshot_of(checkpoint), m)

    def _release_checkpoint(self, checkpoint) -> None:
        """Release ``checkpoint`` in the store and give its ring snapshot slot back."""
        image = self._snapshot_of(checkpoint) if self.ring_snapshots is not None else None
        self.store.release_checkpoint(checkpoint)
        if image is not None:
            self.ring_snapshots.free(image)

    def _hidden_kept(self, s: Sequence):
        """The hidden states a retained sequence keeps for its forks (speculative engines only)."""
        return s.hidden.frozen(s.frontier) if self.draft_window else None

    def _drop_job(self, job: PrefixJob | None) -> None:
        if job is None or job not in self.jobs:
            return
        s = job.sequence
        if s in self.running:
            self._leave(s)
            self.store.finish(s.handle)
        if job.entry is not None:
            self.pending.remove(job.entry)
        if job.owner is not None and job.owner.status == JOB:
            job.owner.status = WAITING
        self.jobs.remove(job)

    # -- the waiting index ------------------------------------------------------------------------------------------
    def _index_waiting(self, req: Request) -> None:
        if not self.caching or req.prompt_ids.size < 2:
            return
        cover = self.waiting_index.covering(req.prompt_ids)
        if cover is None:  # entries this prompt extends are replaced by its own, their requests moved to it
            moved = []
            for old in self.waiting_index.covered(req.prompt_ids):
                self.waiting_index.remove(old)
                moved.extend(old.value)
            entry = self.waiting_index.insert(req.prompt_ids, moved + [req], now=req.arrival)
            for r in moved:
                self._waiting_entries[id(r)] = entry
        else:
            entry = cover
            entry.value.append(req)
        self._waiting_entries[id(req)] = entry

    def _unindex_waiting(self, req: Request) -> None:
        entry = self._waiting_entries.pop(id(req), None)
        if entry is None:
            return
        entry.value.remove(req)
        if any(r.prompt_ids.size == entry.length for r in entry.value):
            return
        # no request left has the entry's tokens as its prompt: index the others by their own prompts
        self.waiting_index.remove(entry)
        for r in entry.value:
            del self._waiting_entries[id(r)]
            self._index_waiting(r)

    def _unqueue(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._unindex_waiting(req)

    # -- state -------------------------------------------------------------------------------------------------------
    @property
    def state(self):
        """The device state the runner holds."""
        return self.runner.state

    def flushed_state(self):
        """The device state with every pending round work applied (an offload's source)."""
        return self.runner.flushed_state()

    def clear_cache(self) -> int:
        """Release every cached prefix no running request uses; returns how many."""
        return self.cache.clear()


def _no_text(token: int) -> None:
    return None


def request_seed(engine_seed: int, arrival: int) -> int:
    """The sampling seed of the ``arrival``-th request (from 0) that gives none."""
    return _mix(engine_seed, arrival + 1)


def _mix(seed: int, i: int) -> int:
    """A 32-bit seed derived from ``seed`` and ``i`` (splitmix64 finalizer)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(i) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**32 - 1)


def _groups(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


def _sampling(seqs: list[Sequence]) -> list | None:
    """Each sequence's sampling config, or ``None`` when every one is greedy."""
    configs = [s.sampling for s in seqs]
    return configs if any(c is not None and not c.greedy for c in configs) else None
