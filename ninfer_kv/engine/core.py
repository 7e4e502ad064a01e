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
3. **prefill**: every sequence still in its prompt gets one chunk (batched, padded to a bucket);
   a sequence whose prompt completes produces its first token;
4. **decode**: every other running sequence produces one token (batched); with lease growth
   (``KVStore(..., entitlement=EntitlementPolicy(kv_lease_growth=True))``) the decoding sequences'
   entitlements are extended first (:meth:`~ninfer_kv.store.KVStore.round_boundary`), and one the
   pool cannot extend, even after evicting cached prefixes, ends with ``"length"``;
5. **finish**: ended sequences are released, or retained and indexed in the prefix cache; ended
   prefix jobs are retained and indexed (their waiting requests are admitted next round).

Every unit follows the store's protocol: ``map_rows`` -> ``take_step_work`` -> one step (the work
applied inside it) -> ``commit_rows``.  An exception inside a step fails only the requests of that
step: their sequences are finished, the device state is repaired with :func:`~ninfer_kv.resync`
(a fresh blank state when the failed step consumed it) and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Sequence as Seq

import numpy as np

from ..device import apply_work_jit, resync, take_step_work
from ..errors import PoolCapacityError
from ..geometry import PAGE_SIZE
from ..models.decoder.buckets import bucket_for, bucket_ladder, pad_rows
from ..models.decoder.sampling import GREEDY, sampling_rows
from ..models.request_checks import token_ids
from ..store import KVStore
from .model import EngineModel
from .outputs import FINISH_ABORT, FINISH_LENGTH, RequestOutput
from .prefix_cache import PrefixCache
from .prefix_index import PrefixIndex
from .requests import FINISHED, JOB, RUNNING, WAITING, PrefixJob, Request, Sequence
from .sampling_params import SamplingParams

__all__ = ["EngineCore", "EngineStats", "MIN_SHARED_TOKENS"]

MIN_SHARED_TOKENS = PAGE_SIZE
"""Tokens that waiting requests must share beyond the cached prefix before a prefix job computes
them once (below that, each request prefills them itself)."""


@dataclasses.dataclass
class EngineStats:
    """Counters of an engine.

    Attributes:
      rounds: calls of :meth:`EngineCore.step`; prefill_units / decode_units: model steps run.
      prefill_tokens / decode_tokens: tokens they processed (padding excluded).
      prefix_jobs: prefixes computed once for several sequences.
      failed_steps: steps that raised (their requests failed, the state was repaired).
    """

    rounds: int = 0
    prefill_units: int = 0
    decode_units: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_jobs: int = 0
    failed_steps: int = 0


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
    ):
        self.model = model
        self.store = store
        self.max_model_len = store.max_context
        self.max_num_seqs = store.max_concurrency
        self.buckets = bucket_ladder(self.max_num_seqs, 2)
        model.prepare(store.layout("main"), self.buckets)
        self.chunk = int(model.prefill_chunk)
        if self.chunk < PAGE_SIZE or self.chunk % PAGE_SIZE:
            raise ValueError(f"the model's prefill_chunk={self.chunk} must be a positive multiple of {PAGE_SIZE}")
        self.vocab_size = int(model.vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.text_state = text_state
        self.decode_token = decode_token
        self.caching = bool(enable_prefix_caching)
        self.seed = int(seed)
        self.state = store.allocate_state()
        self.cache = PrefixCache(store, self.flushed_state)
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
        value), and a refused request changes nothing."""
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
        base = params.seed if params.seed is not None else _mix(self.seed, next(self._arrivals) + 1)
        seeds = tuple(base if i == 0 else _mix(base, i) for i in range(params.n))
        req = Request(request_id, prompt, ids, params, budget, frozenset(params.stop_token_ids or ()),
                      frozenset() if params.ignore_eos else self.eos_token_ids, seeds, next(self._arrivals))
        self.requests[request_id] = req
        self.waiting.append(req)
        self._index_waiting(req)
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
        self.stats.rounds += 1
        self._apply_aborts()
        self._admit()
        produced: set = set()
        pre = [s for s in self.running if s.prefilling]
        for group in _groups(pre, self.buckets[-1]):
            self._unit("prefill", group, produced)
        dec = [s for s in self.running if not s.prefilling and not s.done and id(s) not in produced]
        if dec and self.store.policy.kv_lease_growth:
            dec = self._grow(dec)
        for group in _groups(dec, self.buckets[-1]):
            self._unit("decode", group, produced)
        self._finish_done()
        return self._outputs()

    def _grow(self, seqs: list[Sequence]) -> list[Sequence]:
        """Lease growth: extend the decoding sequences' entitlements at the round boundary, evicting
        cached prefixes while some cannot be covered; a sequence the pool still cannot extend ends
        with finish reason ``"length"`` at its committed frontier (bounded completion)."""
        rows = np.array([s.row for s in seqs], np.int64)
        grant = self.store.round_boundary(rows)
        while grant.length_limited.any() and self.cache.evict_one():
            grant = self.store.round_boundary(rows)
        keep = []
        for s, limited in zip(seqs, grant.length_limited.tolist()):
            if limited:
                s.finish_reason = FINISH_LENGTH
                self._changed[s.request.request_id] = s.request
            else:
                keep.append(s)
        return keep

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
        if self.caching:
            _, pm = self.pending.longest_match(prompt, limit)
            if pm > m:
                return "waiting"
            self._unindex_waiting(req)
            _, shared = self.waiting_index.longest_match(prompt, limit)
            self._index_waiting(req)
            if shared >= m + MIN_SHARED_TOKENS:
                return self._start_job(prompt[:shared], entry, m, owner=None)
        if req.params.n > 1 and m < limit:
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
                    self.store.release_checkpoint(checkpoint)
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
            if self.text_state is not None:
                seq.text = self.text_state(req.prompt_ids, req.params)
            if req.params.logprobs is not None:
                seq.logprobs = []
            req.sequences.append(seq)
            self.running.append(seq)
        if checkpoint is not None:  # a private prefix job's checkpoint: every completion forked it
            self.store.release_checkpoint(checkpoint)
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
        job.sequence = seq
        if owner is None:
            job.entry = self.pending.insert(job.tokens, job, now=self.stats.rounds)
        else:
            owner.status = JOB  # waits for its private prefix
        self.jobs.append(job)
        self.running.append(seq)
        self.stats.prefix_jobs += 1
        return "waiting"

    def _activate(self, prompt: int, budget: int, source, m: int, entry):
        """``store.activate``, evicting cached prefixes (never ``entry``) while the pool lacks pages."""
        while True:
            try:
                if source is None:
                    return self.store.activate(prompt, budget)
                return self.store.activate(prompt, budget, source=source, source_tokens=m)
            except PoolCapacityError:
                if not self.cache.evict_one(exclude=entry):
                    raise

    # -- units ------------------------------------------------------------------------------------------------------
    def _unit(self, kind: str, seqs: list[Sequence], produced: set) -> None:
        n = len(seqs)
        t = self.chunk if kind == "prefill" else 1
        tokens = np.zeros((n, t), np.int32)
        pos = np.zeros(n, np.int32)
        valid = np.zeros(n, np.int32)
        for i, s in enumerate(seqs):
            if kind == "prefill":
                v = min(t, s.target - s.frontier)
                tokens[i, :v] = s.tokens[s.frontier: s.frontier + v]
            else:
                v = 1
                tokens[i, 0] = s.tokens[-1]
            pos[i], valid[i] = s.frontier, v
        rows = np.array([s.row for s in seqs], np.int64)
        ends = pos.astype(np.int64) + valid
        bucket = bucket_for(n, self.buckets)
        padded = pad_rows(tokens, pos, valid, rows, bucket=bucket)
        configs = [s.sampling for s in seqs]
        sampling = None
        if any(c is not None and not c.greedy for c in configs):
            sampling = sampling_rows([c if c is not None else GREEDY for c in configs], bucket)
        self.store.map_rows(rows, ends)
        try:
            self.state, work = take_step_work(self.store, self.state)
            run = self.model.prefill if kind == "prefill" else self.model.decode
            self.state, out = run(self.state, work, padded.tokens, padded.positions, padded.valid, padded.table_rows,
                                  sampling)
            chosen = np.asarray(out.next_tokens)[:n]
        except Exception as exc:  # noqa: BLE001 - a failed step fails its own requests only
            self._fail_unit(seqs, exc)
            return
        self.store.commit_rows(rows, ends)
        if kind == "prefill":
            self.stats.prefill_units += 1
            self.stats.prefill_tokens += int(valid.sum())
        else:
            self.stats.decode_units += 1
            self.stats.decode_tokens += n
        want = [i for i, s in enumerate(seqs) if s.logprobs is not None and int(ends[i]) >= s.target]
        logits = np.asarray(out.logits[: n]) if want else None
        for i, s in enumerate(seqs):
            s.frontier = int(ends[i])
            if s.request is None or s.prefilling:
                continue
            token = int(chosen[i])
            if s.logprobs is not None:
                s.record_logprobs(token, logits[i], s.request.params.logprobs, self.decode_token or _no_text)
            s.append(token)
            produced.add(id(s))
            self._changed[s.request.request_id] = s.request

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
        if _consumed(self.state):
            self.state = self.store.allocate_state()
        self.state, report = resync(self.store, self.state)
        self._handle_lost(report)

    def _handle_lost(self, report) -> None:
        """Requests and cache entries whose content a repair could not restore are given up."""
        lost_seq = set(report.lost_sequences)
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
        lost_ckpt = set(report.lost_checkpoints)
        for entry in list(self.cache.index):
            if entry.value in lost_ckpt:
                for s in self.running:  # forks still running keep their own pages; the entry goes
                    if s.source is entry:
                        s.source = None
                        self.cache.index.unpin(entry)
                self.cache.index.remove(entry)
                self.store.release_checkpoint(entry.value)

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
            ckpt = self.store.finish(s.handle, retain=True)
            self.cache.keep(np.asarray(s.tokens[: s.frontier], np.int32), ckpt, self.stats.rounds)
        else:
            self.store.finish(s.handle)

    def _end_request(self, req: Request, retain: bool = True) -> None:
        for s in req.sequences:
            if s is not None and s in self.running:
                self._release_sequence(s, retain)
        if req.status in (WAITING, JOB):
            self._unqueue(req)
        if req.private_source is not None:
            self.store.release_checkpoint(req.private_source[0])
            req.private_source = None
        req.status = FINISHED
        self._changed[req.request_id] = req

    def _complete_job(self, job: PrefixJob) -> None:
        s = job.sequence
        self._leave(s)
        if job.entry is not None:
            self.pending.remove(job.entry)
        self.jobs.remove(job)
        ckpt = self.store.finish(s.handle, retain=True)
        if job.owner is not None:
            if job.owner.status == FINISHED:  # aborted meanwhile
                self.store.release_checkpoint(ckpt)
            else:
                job.owner.private_source = (ckpt, int(job.tokens.size))
                job.owner.status = WAITING
        else:
            self.cache.keep(job.tokens, ckpt, self.stats.rounds)

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
    def flushed_state(self):
        """The device state with every pending round work applied (an offload's source)."""
        if any(not p.empty for p in self.store.pending_work().values()):
            self.state = apply_work_jit(self.state, self.store.take_work())
        return self.state

    def clear_cache(self) -> int:
        """Release every cached prefix no running request uses; returns how many."""
        return self.cache.clear()


def _no_text(token: int) -> None:
    return None


def _mix(seed: int, i: int) -> int:
    """A 32-bit seed derived from ``seed`` and ``i`` (splitmix64 finalizer)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(i) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**32 - 1)


def _groups(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


def _consumed(state) -> bool:
    """Whether a step consumed ``state`` (its buffers were donated or deleted)."""
    sync = getattr(state, "sync", None)
    return sync is not None and hasattr(sync, "is_deleted") and sync.is_deleted()
