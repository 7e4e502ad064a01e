"""Continuous batching over the KV store: admission, rounds, prefix checkpoints, finish.

A *round* is::

    admit     FIFO: activate queued requests while an execution row is free and the store can
              activate them (evicting cold prefix checkpoints when Device pages are short)
    prefill   one 128-token chunk for every lane still in its prompt
    retain    prefix jobs whose system prompt is complete: finish(retain=True) with a state image
    boundary  kv_lease_growth: grow lease windows (relieving pressure first); lanes whose lease
              cannot cover another token end with finish reason "length" (bounded completion)
    decode    one token per decoding lane (backend off) or one MTP round (backend mtp)
    finish    lanes whose budget is spent release every page

Shared system prompts.  The first request of a system prompt whose checkpoint does not exist is
served in two parts: a *prefix job* activates a sequence of just the system prompt, prefills it and
retains it as a checkpoint (``finish(retain=True, state_image=..., frontiers=...)``); the request
then goes back to the head of the queue and forks from that checkpoint like every later request of
the same system prompt: full pages are shared, the partial tail page is copied (COW), and only the
user suffix is prefilled.  Requests of a system prompt whose prefix job is running wait for it.

Admission never overcommits: a request is activated only when the store can reserve its whole
entitlement (or, with ``kv_lease_growth``, its first window); otherwise it waits in the queue.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from ..geometry import PAGE_SIZE, ceil_div
from ..planning import PoolKind
from ..store import KVStore, PoolCapacityError
from .engine import Lane, ModelEngine
from .prefix_cache import CachedPrefix, PrefixCache
from .requests import Request

__all__ = ["RequestRecord", "SchedulerStats", "Scheduler", "FINISH_LENGTH", "FINISH_STOP", "check_workload_fits"]

FINISH_LENGTH = "length"
"""Finish reason of a request that spent its budget or whose lease could not grow further."""

FINISH_STOP = "stop"
"""Finish reason of a request that generated one of its stop tokens (the model's EOS)."""


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """A finished request.

    Attributes:
      request: the request.
      generated: int32 generated tokens.
      logits: float32 ``(len(generated), V)``: the logits that chose each token.
      finish_reason: :data:`FINISH_STOP` when the last generated token is a stop token, else
        :data:`FINISH_LENGTH`.
      bounded: ``True`` when the lease could not grow and the request ended before its budget.
      prefix_hit: the request forked a checkpoint that already existed when it was admitted.
      admitted_round, finished_round: scheduler rounds.
    """

    request: Request
    generated: np.ndarray
    logits: np.ndarray
    finish_reason: str
    bounded: bool
    prefix_hit: bool
    admitted_round: int
    finished_round: int


@dataclasses.dataclass
class SchedulerStats:
    rounds: int = 0
    admitted: int = 0
    prefix_jobs: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    admission_waits: int = 0  # rounds in which the queue head could not be admitted
    bounded_completions: int = 0
    lease_pages_granted: int = 0  # Main pages added to entitlements at round boundaries
    peak_active: int = 0
    peak_pages: dict = dataclasses.field(default_factory=dict)  # pool -> max(capacity - available)
    peak_host_bytes: int = 0


_RETRY = object()


def check_workload_fits(requests: Sequence[Request], max_context: int, logical_pages: int, lead: int = 0) -> None:
    """Raise ``ValueError`` unless every request fits one sequence: ``prompt + budget <= S`` and, with
    an MTP draft lead of ``lead`` tokens, ``prompt + budget + lead <= L * P``."""
    ceiling = logical_pages * PAGE_SIZE
    for r in requests:
        if r.total_tokens > max_context:
            raise ValueError(
                f"request {r.id} needs prompt {r.prompt_tokens} + budget {r.max_new_tokens} = {r.total_tokens} tokens "
                f"but --max-context is {max_context} (allowed: >= {max(q.total_tokens for q in requests)} for this workload)"
            )
        if r.total_tokens + lead > ceiling:
            raise ValueError(
                f"request {r.id}: {r.total_tokens} tokens plus the MTP draft lead of {lead} exceed the logical capacity "
                f"L*P = {ceiling} tokens; raise --max-context"
            )


@dataclasses.dataclass
class _Pending:
    request: Request
    producer: bool = False  # its prefix job has just retained the checkpoint it forks


class Scheduler:
    """Serves a workload with continuous batching (see the module docstring).

    Args:
      engine: the model engine (holds the store).
      cache: the prefix checkpoint cache over the same store.
      requests: the workload in arrival order.
      on_finish: called with each :class:`RequestRecord` (progress reporting).
    """

    def __init__(
        self,
        engine: ModelEngine,
        cache: PrefixCache,
        requests: Sequence[Request],
        *,
        on_finish: Callable[[RequestRecord], None] | None = None,
    ):
        self.engine = engine
        self.store: KVStore = engine.store
        self.cache = cache
        self.queue: collections.deque[_Pending] = collections.deque(_Pending(r) for r in requests)
        self.lanes: list[Lane] = []
        self.records: list[RequestRecord] = []
        self.producing: set[int] = set()
        self.on_finish = on_finish
        self.stats = SchedulerStats()
        self.round = 0
        self.growth = self.store.policy.kv_lease_growth
        self.max_batch = max(engine.buckets)
        lead = engine.draft_window - 1 if engine.mtp else 0
        check_workload_fits(requests, self.store.max_context, self.store.logical_pages, lead)

    # -- main loop --------------------------------------------------------------------------------------
    def run(self) -> list[RequestRecord]:
        """Serve every request; returns the records in completion order."""
        while self.busy:
            self.step_round()
        return self.records

    @property
    def busy(self) -> bool:
        """Requests are waiting or being served."""
        return bool(self.queue or self.lanes)

    def step_round(self) -> None:
        """One scheduling round: admit, prefill a chunk, retain finished prefixes, decode, finish."""
        self.round += 1
        self._admit()
        if not self.lanes:
            head = self.queue[0].request
            raise RuntimeError(
                f"request {head.id} ({head.total_tokens} tokens) cannot be activated on an idle store: "
                f"{self.store.pool('main').available} of {self.store.pool('main').capacity} Main pages are "
                f"available; raise --kv-capacity"
            )
        self._prefill()
        self._retain_prefixes()
        self._decode()
        self._finish_done()
        self._sample()
        self.stats.rounds = self.round

    def _batches(self, lanes: list[Lane]):
        for i in range(0, len(lanes), self.max_batch):
            yield lanes[i : i + self.max_batch]

    def _prefill(self) -> None:
        for batch in self._batches([lane for lane in self.lanes if lane.prefilling]):
            self.engine.prefill(batch)

    def _decode(self) -> None:
        lanes = [lane for lane in self.lanes if not lane.prefix_job and not lane.prefilling and not lane.done]
        if not lanes:
            return
        limits = self._round_boundary(lanes)
        live = [(lane, lim) for lane, lim in zip(lanes, limits) if lim >= 1]
        for batch_start in range(0, len(live), self.max_batch):
            batch = live[batch_start : batch_start + self.max_batch]
            if self.engine.mtp:
                self.engine.speculate([l for l, _ in batch], [lim for _, lim in batch])
            else:
                self.engine.decode([l for l, _ in batch])

    # -- admission --------------------------------------------------------------------------------------
    def _admit(self) -> None:
        waited = False
        while self.queue:
            pending = self.queue[0]
            req = pending.request
            source: CachedPrefix | None = None
            prefix_job = False
            if req.prefix_group is not None:
                source = self.cache.get(req.prefix_group)
                if source is None:
                    if req.prefix_group in self.producing:
                        waited = True  # its system prompt is being computed: wait for the checkpoint
                        break
                    prefix_job = True
            if prefix_job:
                handle = self._activate(req.prefix_tokens, 0, None)
            else:
                handle = self._activate(req.prompt_tokens, req.max_new_tokens, source)
            if handle is _RETRY:
                continue  # the head's checkpoint was given up to make room: re-plan the head
            if handle is None:
                waited = True
                break
            self.queue.popleft()
            self._start_lane(pending, handle, source, prefix_job)
        if waited and self.queue:
            self.stats.admission_waits += 1

    def _start_lane(self, pending: _Pending, handle, source: CachedPrefix | None, prefix_job: bool) -> None:
        req = pending.request
        prompt = req.prompt.tolist()
        if prefix_job:
            lane = Lane(req, handle, self.store.row(handle), True, prompt[: req.prefix_tokens], req.prefix_tokens)
            self.producing.add(req.prefix_group)
            self.stats.prefix_jobs += 1
        else:
            lane = Lane(req, handle, self.store.row(handle), False, prompt, req.prompt_tokens)
            self.stats.admitted += 1
        lane.hidden_tail = self.engine.new_hidden_tail()
        lane.admitted_round = self.round
        if source is not None:
            image = self.store.checkpoint(source.checkpoint).state_image
            self.engine.resume(lane, image)
            source.active_forks += 1
            source.forks += 1
            source.last_use = self.round
            lane.source = source
            if not pending.producer:
                lane.prefix_hit = True
                self.stats.prefix_hits += 1
                self.stats.prefix_tokens_reused += source.frontier
        self.lanes.append(lane)
        self.stats.peak_active = max(self.stats.peak_active, len(self.lanes))

    def _main_pages_needed(self, prompt: int, budget: int, source: CachedPrefix | None) -> int:
        """Main pages an activation takes from the pool's available pages (estimate for eviction)."""
        target = prompt + budget
        lo, _ = self.store.policy.activation_tokens(prompt, target)
        need = ceil_div(min(lo, self.store.logical_pages * PAGE_SIZE), PAGE_SIZE)
        if source is not None:
            need = max(need, ceil_div(source.frontier, PAGE_SIZE))
            if self.cache.on_device(source):
                need -= source.frontier // PAGE_SIZE  # full pages are shared, not taken
        return need

    def _activate(self, prompt: int, budget: int, source: CachedPrefix | None):
        """Activate if the store can; evict cold checkpoints only when that makes it fit."""
        store = self.store
        if store.active_rows().size >= store.max_concurrency:
            return None
        pool = store.pool("main")
        need = self._main_pages_needed(prompt, budget, source)
        victims = self.cache.victims(exclude=source)
        if not self.lanes and source is not None and self.cache.on_device(source):
            victims.append(source)  # idle store: even the source may go (it is restored or recomputed)
        if need > pool.available + sum(self.cache.freeable_pages(v) for v in victims):
            return None
        while True:
            while need > pool.available and victims:
                self._evict(victims.pop(0))
            if source is not None and self.cache.get(source.group) is not source:
                return _RETRY  # the source itself was released: its prefix is recomputed
            try:
                if source is None:
                    return store.activate(prompt, budget)
                return store.activate(prompt, budget, source=source.checkpoint)
            except PoolCapacityError:
                if not victims:
                    return None
                self._evict(victims.pop(0))

    def _evict(self, entry: CachedPrefix) -> None:
        self.cache.evict(entry)

    # -- retain / finish ---------------------------------------------------------------------------------
    def _retain_prefixes(self) -> None:
        done = [lane for lane in self.lanes if lane.prefix_job and lane.done]
        for lane in done:
            image, frontiers = self.engine.state_image(lane)
            ck = self.store.finish(lane.handle, retain=True, state_image=image, frontiers=frontiers)
            req = lane.request
            self.cache.add(req.prefix_group, ck, lane.frontier, self.round)
            self.producing.discard(req.prefix_group)
            self.lanes.remove(lane)
            self.queue.appendleft(_Pending(req, producer=True))

    def _round_boundary(self, lanes: list[Lane]) -> list[int]:
        """Tokens each lane may produce this round; ends lanes whose lease cannot grow (``length``)."""
        per_round = self.engine.draft_window + 1 if self.engine.mtp else 1
        want = [min(per_round, lane.remaining) for lane in lanes]
        if not self.growth:
            return want
        rows = np.array([lane.row for lane in lanes], np.int64)
        front = np.array([lane.frontier for lane in lanes], np.int64)
        victims = self.cache.victims()
        while True:
            grant = self.store.round_boundary(rows)
            self.stats.lease_pages_granted += int(np.sum(grant.granted_pages[PoolKind.MAIN]))
            room = grant.covered_tokens - front
            short = room < np.array(want)
            if not short.any() or not victims:
                break
            self._evict(victims.pop(0))  # pressure: give the lanes the pages of a cold checkpoint
        limits = [int(min(w, r)) for w, r in zip(want, room)]
        for lane, lim in zip(lanes, limits):
            if lim < 1:
                self._finish(lane, bounded=True)
        return limits

    def _finish_done(self) -> None:
        for lane in [lane for lane in self.lanes if not lane.prefix_job and lane.done]:
            self._finish(lane, bounded=False)

    def _finish(self, lane: Lane, *, bounded: bool) -> None:
        self.store.finish(lane.handle)
        if lane.source is not None:
            lane.source.active_forks -= 1
        self.lanes.remove(lane)
        req = lane.request
        gen = np.asarray(lane.tokens[req.prompt_tokens :], np.int32)
        logits = np.stack(lane.generated_logits) if lane.generated_logits else np.zeros((0, self.engine.model.vocab_size), np.float32)
        if bounded:
            self.stats.bounded_completions += 1
        stopped = not bounded and gen.size > 0 and int(gen[-1]) in req.stop_tokens
        record = RequestRecord(
            req, gen, logits, FINISH_STOP if stopped else FINISH_LENGTH, bounded, lane.prefix_hit,
            lane.admitted_round, self.round
        )
        self.records.append(record)
        if self.on_finish is not None:
            self.on_finish(record)

    # -- sampling ----------------------------------------------------------------------------------------
    def _sample(self) -> None:
        peaks = self.stats.peak_pages
        for kind in self.store.pool_kinds:
            pool = self.store.pool(kind)
            used = pool.capacity - pool.available
            peaks[kind.value] = max(peaks.get(kind.value, 0), used)
        if self.cache.host_tier:
            used = self.store.host_occupancy().used_bytes
            self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, int(used))
