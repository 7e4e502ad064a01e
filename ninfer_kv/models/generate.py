"""Serve a few sequences of one decoder through the paged store: chunked prefill, decode, sampling, EOS.

:class:`PagedGenerator` owns a :class:`~ninfer_kv.store.KVStore` (Main pool only), the caller-side
:class:`~ninfer_kv.KVDeviceState` and the decoder's jitted state steps.  Each :meth:`~PagedGenerator.step`
is one round: every sequence still in its prompt gets one prefill chunk (batched), every other one
decodes one token (batched), following the store's protocol (``map`` -> ``take_step_work`` ->
one dispatch -> ``commit``).  A sequence ends at one of its stop tokens (finish reason
``"stop"``), when its output budget is spent or when it reaches the context (``"length"``); it is then
released, or retained as a checkpoint another sequence can fork (``add(..., source=checkpoint)``).

Tokens are chosen inside the steps (:mod:`ninfer_kv.models.decoder.sampling`): greedy rows take the
argmax, sampled rows fold their sequence's key with the position of the token produced, so a fixed
seed gives the same tokens whatever the batch and across forks.  A batch whose rows are all greedy
runs the steps without sampling inputs.

Every verb checks all of its arguments (token ids are integers in ``[0, vocab)``, counts are bounded,
a fork's source is a held checkpoint of this generator) before it changes anything, and the store's
own verbs are atomic, so a refused call leaves the generator and its store as they were;
:meth:`~PagedGenerator.generate` is all or nothing.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterable, NamedTuple, Sequence

import jax
import numpy as np

from ..device.allocation import allocate_state
from ..device.ring_snapshots import RingSnapshots, copy_ring
from ..device.rounds import take_step_work
from ..device.state import KVDeviceState
from ..planning import ExplicitCapacity, KVPlan, plan_kv_cache
from ..planning.pool_set import full_context_capacity
from ..schema.buckets import bucket_for, bucket_ladder
from ..schema.profiles import KVProfile
from ..store import CheckpointHandle, KVStore, SequenceHandle
from .decoder.padding import pad_rows
from .decoder.config import PREFILL_CHUNK, ModelConfig, StepConfig
from .decoder.sampling import GREEDY, SamplingConfig, sampling_rows
from .decoder.steps import ModelSteps, shared_steps
from .request_checks import check_callback, check_max_new_tokens, check_sampling, token_ids

__all__ = [
    "GeneratedSequence", "PagedGenerator", "FINISH_STOP", "FINISH_LENGTH", "generator_buckets",
    "generator_plan",
]

FINISH_STOP = "stop"
"""Finish reason of a sequence that produced one of its stop tokens."""
FINISH_LENGTH = "length"
"""Finish reason of a sequence that spent its output budget or reached the context."""


def generator_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch buckets of a generator serving ``max_batch`` sequences:
    :func:`~ninfer_kv.schema.buckets.bucket_ladder` of ``max_batch``."""
    return bucket_ladder(max_batch)


def generator_plan(
    config: ModelConfig, *, profile: KVProfile | str, max_context: int, max_batch: int, kv_capacity: int | None = None
) -> KVPlan:
    """The store plan of a :class:`PagedGenerator` built with these arguments, without allocating
    anything (``plan.device_bytes`` is what its KV state will take).  A model with window rings gets
    ``max_batch`` snapshot slots: that many retained sequences keep their rings for forks."""
    capacity = kv_capacity if kv_capacity is not None else full_context_capacity(max_context, max_batch)
    kv = config.kv_config(profile)
    if kv.rings is not None:
        kv = dataclasses.replace(kv, rings=dataclasses.replace(kv.rings, snapshots=max_batch))
    return plan_kv_cache(kv, max_context=max_context, max_concurrency=max_batch, policy=ExplicitCapacity(capacity))


@dataclasses.dataclass(eq=False)
class GeneratedSequence:
    """One sequence of a :class:`PagedGenerator`.

    Attributes:
      tokens: every token so far (the prompt, then the generated ones).
      prompt_tokens: the prompt's length.
      max_new_tokens: the output budget.
      sampling: how it chooses tokens.
      stop_tokens: ids that end it.
      retain: keep its pages as a checkpoint when it finishes.
      frontier: tokens whose K/V are in the store.
      finish_reason: ``None`` while active, else :data:`FINISH_STOP` or :data:`FINISH_LENGTH`.
      checkpoint: with ``retain``, the checkpoint it left (frontier ``len(tokens) - 1``).
      logits: with the generator's ``keep_logits``, the float32 logits that chose each generated token.
    """

    handle: SequenceHandle
    row: int
    tokens: list
    prompt_tokens: int
    max_new_tokens: int
    sampling: SamplingConfig
    stop_tokens: frozenset
    retain: bool
    frontier: int
    finish_reason: str | None = None
    checkpoint: CheckpointHandle | None = None
    logits: list = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        """The generated tokens."""
        return self.tokens[self.prompt_tokens:]

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still missing from the store."""
        return self.frontier < self.prompt_tokens

    @property
    def done(self) -> bool:
        """It has finished."""
        return self.finish_reason is not None


class PagedGenerator:
    """Generates continuations of prompts through a paged KV store (see the module docstring).

    Args:
      params: the decoder's parameters (``init_params`` or a loaded checkpoint's).
      config: the decoder configuration.
      profile: the KV profile of the Main pool.
      max_context: tokens per sequence, prompt and output (S).
      max_batch: sequences served at once (C, the largest batch bucket).
      impl: op implementation, one of :func:`ninfer_kv.ops.registry.impl_choices` (``"auto"``: FFI on CPU,
        Pallas on GPU, Mosaic on TPU).
      kv_capacity: Main capacity in tokens (default
        :func:`~ninfer_kv.planning.pool_set.full_context_capacity`, ``max_batch * ceil(S / 64) * 64``:
        every sequence can reach ``max_context``).
      prefill_chunk: tokens per prefill call (a multiple of 64).
      keep_logits: keep the logits that chose each token (tests, margins).
    """

    def __init__(
        self,
        params: dict,
        config: ModelConfig,
        *,
        profile: KVProfile | str = KVProfile.BF16,
        max_context: int = 2048,
        max_batch: int = 8,
        impl: str = "auto",
        kv_capacity: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        keep_logits: bool = False,
    ):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        for name, value in (("max_context", max_context), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= 1")
        self.config = config
        self.params = params
        self.max_context = max_context
        self.keep_logits = keep_logits
        step_config = StepConfig(model=config, profile=profile, impl=impl, prefill_chunk=prefill_chunk,
                                 batch_buckets=generator_buckets(max_batch))
        plan = generator_plan(config, profile=step_config.profile, max_context=max_context, max_batch=max_batch,
                              kv_capacity=kv_capacity)
        self.plan = plan
        self.store = KVStore(plan)
        self.steps: ModelSteps = shared_steps(step_config)
        self.params = self.steps.prepare_params(params)
        self.chunk = step_config.prefill_chunk
        self.buckets = step_config.batch_buckets
        self.state: KVDeviceState = allocate_state(self.store)
        self.snapshots = None if plan.rings is None else RingSnapshots(plan.rings, self._copy_ring)
        self.active: list[GeneratedSequence] = []
        self._sequences: weakref.WeakSet = weakref.WeakSet()  # every sequence this generator started

    # -- sequences ---------------------------------------------------------------------------------
    def add(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig = GREEDY,
        stop_tokens: Iterable[int] = (),
        retain: bool = False,
        source: GeneratedSequence | None = None,
    ) -> GeneratedSequence:
        """Start a sequence; ``source`` forks a finished, retained sequence whose tokens the prompt extends.

        The store reserves ``len(prompt) + max_new_tokens`` tokens (at most ``max_context``); the
        activation fails with the store's error when the pool cannot hold it.  Every argument is
        checked before the store is touched (``TypeError`` / ``ValueError`` naming the argument, the
        value and what is allowed), so a refused call — by a check or by the store — changes nothing.
        """
        request = self._request("prompt", prompt, source)
        check_max_new_tokens(max_new_tokens)
        check_sampling("sampling", sampling)
        stops = self._stop_tokens(stop_tokens)
        if not isinstance(retain, (bool, np.bool_)):
            raise TypeError(f"retain={retain!r} is invalid; it must be True or False")
        return self._start(request, int(max_new_tokens), sampling, stops, bool(retain))

    def release(self, seq: GeneratedSequence) -> None:
        """Release a retained sequence's checkpoint (nothing to do once released, or without ``retain``).

        ``seq`` must be a finished sequence of this generator."""
        self._own("seq", seq)
        if not seq.done:
            raise ValueError("seq is still active: only a finished sequence added with retain=True holds a checkpoint")
        if seq.checkpoint is not None:
            image = self.store.checkpoint(seq.checkpoint).state_image
            self.store.release_checkpoint(seq.checkpoint)
            seq.checkpoint = None
            if self.snapshots is not None:
                self.snapshots.free(image)

    # -- checks (nothing here changes the generator or the store) ------------------------------------
    def _own(self, name: str, seq) -> None:
        if not isinstance(seq, GeneratedSequence):
            raise TypeError(f"{name} must be a GeneratedSequence of this generator, got {type(seq).__name__}")
        if seq not in self._sequences:
            raise ValueError(f"{name} belongs to another generator; only this generator's sequences are accepted")

    def _stop_tokens(self, stop_tokens) -> frozenset:
        if isinstance(stop_tokens, (int, np.integer)):
            raise TypeError(f"stop_tokens={stop_tokens!r} is a single token id; pass a list such as [{int(stop_tokens)}]")
        return frozenset(token_ids("stop_tokens", stop_tokens, self.config.vocab_size))

    def _request(self, name: str, prompt, source) -> "_Request":
        """The checked prompt tokens and, for a fork, the source's frontier and checkpoint."""
        tokens = token_ids(name, prompt, self.config.vocab_size)
        if not tokens:
            raise ValueError(f"{name} is empty; it must hold at least one token")
        if len(tokens) >= self.max_context:
            raise ValueError(f"{name} has {len(tokens)} tokens; max_context={self.max_context} leaves no room to "
                             f"generate (allowed: at most {self.max_context - 1})")
        if source is None:
            return _Request(tokens, 0, None)
        self._own("source", source)
        if not source.done or not source.retain:
            raise ValueError("source must be a finished sequence added with retain=True "
                             f"({'still active' if not source.done else 'added without retain'})")
        if source.checkpoint is None or source.checkpoint not in self.store.checkpoints():
            raise ValueError("source's checkpoint was released; fork only a sequence whose checkpoint is held")
        if self.snapshots is not None and self.store.checkpoint(source.checkpoint).state_image is None:
            raise ValueError(f"source kept no snapshot of its window rings: at most max_batch="
                             f"{self.store.max_concurrency} retained sequences of a model with window rings keep one "
                             f"(release() another before it finishes)")
        base = source.tokens[: len(source.tokens) - 1]
        if len(tokens) <= len(base) or tokens[: len(base)] != base:
            raise ValueError(f"a fork's prompt must extend its source's {len(base)} tokens by at least one token")
        return _Request(tokens, len(base), source.checkpoint)

    def _start(self, request: "_Request", max_new_tokens: int, sampling: SamplingConfig, stops: frozenset,
               retain: bool) -> GeneratedSequence:
        """Activate a checked request (the store's activation is atomic: a refusal changes nothing)."""
        tokens = request.tokens
        budget = min(max_new_tokens, self.max_context - len(tokens))
        handle = self.store.activate(len(tokens), budget, source=request.checkpoint)
        if self.snapshots is not None and request.checkpoint is not None:  # the ring layers resume too
            self.snapshots.restore(self.store.checkpoint(request.checkpoint).state_image, self.store.row(handle))
        seq = GeneratedSequence(handle, self.store.row(handle), tokens, len(tokens), budget, sampling, stops, retain,
                                request.frontier)
        self.active.append(seq)
        self._sequences.add(seq)
        return seq

    # -- rounds --------------------------------------------------------------------------------------
    def _run(self, name: str, seqs: list[GeneratedSequence], tokens: np.ndarray, pos: np.ndarray, valid: np.ndarray):
        rows = np.array([s.row for s in seqs], np.int64)
        ends = pos.astype(np.int64) + valid
        self.store.map(rows, ends)
        bucket = bucket_for(len(seqs), self.buckets)
        padded = pad_rows(tokens, pos, valid, rows, bucket=bucket)
        args = [padded.tokens, padded.positions, padded.valid, padded.table_rows]
        if any(not s.sampling.greedy for s in seqs):
            args.append(sampling_rows([s.sampling for s in seqs], bucket))
        self.state, work = take_step_work(self.store, self.state)
        self.state, out = self.steps.on_state(name)(self.params, self.state, work, *args)
        self.store.commit(rows, ends)
        chosen = np.asarray(out.next_tokens)[: len(seqs)]
        logits = np.asarray(out.logits)[: len(seqs)] if self.keep_logits else None
        return chosen, logits, ends

    def _append(self, seq: GeneratedSequence, token: int, logits) -> None:
        seq.tokens.append(int(token))
        if logits is not None:
            seq.logits.append(np.array(logits, np.float32))
        if int(token) in seq.stop_tokens:
            seq.finish_reason = FINISH_STOP
        elif len(seq.generated) >= seq.max_new_tokens or len(seq.tokens) >= self.max_context:
            seq.finish_reason = FINISH_LENGTH

    def step(self) -> list[tuple[GeneratedSequence, int]]:
        """One round (module docstring); returns the ``(sequence, token)`` pairs it produced, in order."""
        produced: list[tuple[GeneratedSequence, int]] = []
        batch_max = max(self.buckets)
        pre = [s for s in self.active if s.prefilling]
        for i in range(0, len(pre), batch_max):
            group = pre[i : i + batch_max]
            t = self.chunk
            tokens = np.zeros((len(group), t), np.int32)
            pos = np.zeros(len(group), np.int32)
            valid = np.zeros(len(group), np.int32)
            for j, s in enumerate(group):
                n = min(t, s.prompt_tokens - s.frontier)
                tokens[j, :n] = s.tokens[s.frontier : s.frontier + n]
                pos[j], valid[j] = s.frontier, n
            chosen, logits, ends = self._run("prefill", group, tokens, pos, valid)
            for j, s in enumerate(group):
                s.frontier = int(ends[j])
                if not s.prefilling:
                    self._append(s, chosen[j], None if logits is None else logits[j])
                    produced.append((s, int(chosen[j])))
        dec = [s for s in self.active if not s.prefilling and not s.done and not any(s is p for p, _ in produced)]
        for i in range(0, len(dec), batch_max):
            group = dec[i : i + batch_max]
            tokens = np.array([[s.tokens[-1]] for s in group], np.int32)
            pos = np.array([s.frontier for s in group], np.int32)
            chosen, logits, ends = self._run("decode", group, tokens, pos, np.ones(len(group), np.int32))
            for j, s in enumerate(group):
                s.frontier = int(ends[j])
                self._append(s, chosen[j], None if logits is None else logits[j])
                produced.append((s, int(chosen[j])))
        for s in [s for s in self.active if s.done]:
            self.active.remove(s)
            if s.retain:
                image = None if self.snapshots is None else self.snapshots.capture(s.row, s.frontier)
                s.checkpoint = self.store.finish(s.handle, retain=True, state_image=image)
            else:
                self.store.finish(s.handle)
        return produced

    def _copy_ring(self, src: int, dst: int) -> None:
        self.state = copy_ring(self.state, src, dst)

    def run(self, on_token: Callable[[GeneratedSequence, int], None] | None = None) -> None:
        """Run rounds until every sequence has finished, calling ``on_token`` for each produced token."""
        check_callback(on_token)
        while self.active:
            for seq, token in self.step():
                if on_token is not None:
                    on_token(seq, token)
        jax.block_until_ready(self.state)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY,
        stop_tokens: Iterable[int] = (),
        on_token: Callable[[GeneratedSequence, int], None] | None = None,
    ) -> list[GeneratedSequence]:
        """Add every prompt (one sampling config for all, or one each), run to completion, return them in order.

        All or nothing: every prompt and config is checked first; when an activation fails (the
        store's capacity), the sequences this call already added are finished and dropped, and the
        error propagates with the generator as before the call."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise TypeError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
        check_max_new_tokens(max_new_tokens)
        stops = self._stop_tokens(stop_tokens)
        check_callback(on_token)
        if isinstance(sampling, SamplingConfig):
            configs = [sampling] * len(prompts)
        elif isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence):
            raise TypeError(f"sampling must be a SamplingConfig or a list of them, got {type(sampling).__name__}")
        else:
            configs = list(sampling)
        if len(configs) != len(prompts):
            raise ValueError(f"{len(configs)} sampling configs for {len(prompts)} prompts")
        for i, c in enumerate(configs):
            check_sampling(f"sampling[{i}]", c)
        for i, p in enumerate(prompts):
            if isinstance(p, (int, np.integer)):
                raise TypeError(f"prompts[{i}]={p!r} is a token id, not a prompt; prompts is a list of prompts "
                                f"such as [[1, 2, 3]]")
        requests = [self._request(f"prompts[{i}]", p, None) for i, p in enumerate(prompts)]
        seqs: list[GeneratedSequence] = []
        try:
            for request, c in zip(requests, configs):
                seqs.append(self._start(request, int(max_new_tokens), c, stops, False))
        except BaseException:
            for seq in reversed(seqs):
                self.active.remove(seq)
                self._sequences.discard(seq)
                self.store.finish(seq.handle)
            raise
        self.run(on_token)
        return seqs


class _Request(NamedTuple):
    """A checked prompt: its tokens, the frontier a fork starts from and the checkpoint it forks."""

    tokens: list
    frontier: int
    checkpoint: CheckpointHandle | None
