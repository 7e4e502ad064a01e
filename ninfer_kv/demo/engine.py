"""The demo's model engine: runs the jitted model steps over the store's pools.

One *unit* is one call of a jitted step for a batch of lanes.  Every unit follows the store's
protocol (docs/API.md, "Device state and round work")::

    map_rows(rows, frontier + tokens written)   # pages from each lane's own reservation
    work = take_work()                          # table rows, COW copies, Host restores since the last unit
    state, out = step(params, state, work, ...) # one dispatch: apply_work, then the model step (state donated)
    commit_rows / settle_rows                   # only after the unit succeeded

The engine owns the :class:`~ninfer_kv.KVDeviceState` (the store is host-only).  Every step takes
the work padded to one fixed shape (:func:`~ninfer_kv.store.step_work_shape`), so a step compiles
once per batch bucket;
a larger work (COW copies or Host restores after activations, a burst of table rows) is applied
alone first with :func:`~ninfer_kv.apply_work_jit` and the step gets the next, empty, take.

Lanes and the MTP pool.  The MTP head's KV at position ``i`` is computed from the pair
``(h_i, t_{i+1})``: the main model's hidden state at ``i`` and the token after it.  A lane keeps
the main hidden states it has not yet turned into MTP KV (``hidden_tail``, positions
``[mtp_frontier, frontier)``) and forms every pair whose next token is known.  Hence:

* after a prefill chunk the MTP pool catches up with Main (the next token is the next prompt
  token, or the token the chunk generated);
* a checkpoint at a system-prompt frontier ``F`` holds Main through ``F`` and MTP through
  ``F - 1`` — the pair at ``F - 1`` needs the first suffix token, which differs per request — and
  its :class:`StateImage` carries ``h_{F-1}``, so a fork forms that pair itself;
* an MTP round extends the pending pairs and drafts ``K`` tokens (MTP leads Main by ``K - 1``
  provisional positions), the verify step checks them, and both pools settle: Main commits the
  accepted tokens plus the bonus token, MTP commits the canonical pairs, and both trim their
  rejected tails.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from ..planning import PoolKind
from ..store import KVDeviceState, KVStore, SequenceHandle, apply_work_jit, step_work_shape, take_step_work
from ..models.decoder import ModelConfig, ModelSteps, bucket_for, pad_rows
from .requests import Request

__all__ = ["StateImage", "Lane", "ModelEngine", "model_fingerprint"]

MAIN, MTP = PoolKind.MAIN, PoolKind.MTP


def model_fingerprint(model: ModelConfig, seed: int, profile: str) -> str:
    """A short identity of (model configuration, weights seed, KV profile): what a state image is valid for."""
    text = f"{model!r}|seed={seed}|profile={profile}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class StateImage:
    """The model state retained with a checkpoint besides its KV pages.

    In this decoder the KV pages *are* the recurrent state of the main model, so the image only
    names what it belongs to: the model fingerprint and the frontier of every pool.  With the MTP
    backend it also holds ``h_{F-1}``, the main hidden state at the last Main position, which the
    first MTP pair after the checkpoint needs.

    Attributes:
      model: :func:`model_fingerprint` of the engine that produced it.
      frontiers: committed frontier per pool name (``{"main": F}`` or ``{"main": F, "mtp": F - 1}``).
      hidden: float32 ``(d_model,)`` main hidden state at position ``F - 1`` (MTP only), read-only.
    """

    model: str
    frontiers: dict
    hidden: np.ndarray | None = None


@dataclasses.dataclass(eq=False)
class Lane:
    """One active sequence of the engine.

    Attributes:
      request: the request being served.
      handle, row: the store's sequence handle and execution row.
      prefix_job: ``True`` while the lane only computes the request's system prompt, to be
        retained as a checkpoint (its sequence holds ``request.prefix_tokens`` prompt tokens).
      tokens: prompt tokens followed by the generated tokens (host ints).
      prefill_end: tokens to prefill (the system prompt for a prefix job, else the prompt).
      frontier: Main committed frontier; ``tokens[frontier:]`` are known but not yet in the KV.
      mtp_frontier: MTP committed frontier; ``hidden_tail`` holds ``h_i`` for
        ``i in [mtp_frontier, frontier)``.
      generated_logits: float32 logits that chose each generated token (dense check).
      source: the checkpoint entry this lane forked from (or ``None``).
      admitted_round: the scheduler round of the activation.
      prefix_hit: the lane forked a checkpoint that existed when it was admitted.
    """

    request: Request
    handle: SequenceHandle
    row: int
    prefix_job: bool
    tokens: list
    prefill_end: int
    frontier: int = 0
    mtp_frontier: int = 0
    hidden_tail: np.ndarray | None = None
    generated_logits: list = dataclasses.field(default_factory=list)
    source: object = None
    admitted_round: int = 0
    prefix_hit: bool = False

    @property
    def prefilling(self) -> bool:
        return self.frontier < self.prefill_end

    @property
    def generated(self) -> int:
        """Tokens generated so far (0 for a prefix job)."""
        return 0 if self.prefix_job else len(self.tokens) - self.request.prompt_tokens

    @property
    def remaining(self) -> int:
        """Output budget left."""
        return self.request.max_new_tokens - self.generated

    @property
    def done(self) -> bool:
        """Budget spent, a stop token generated, or a prefix job whose system prompt is complete in every pool."""
        if self.prefix_job:
            return not self.prefilling
        if self.generated > 0 and self.tokens[-1] in self.request.stop_tokens:
            return True
        return self.remaining <= 0


@dataclasses.dataclass
class UnitStats:
    """Counters of the units the engine ran."""

    units: dict = dataclasses.field(default_factory=dict)  # step name -> calls
    buckets: dict = dataclasses.field(default_factory=dict)  # step name -> set of batch buckets used
    prefill_tokens: int = 0
    decode_tokens: int = 0
    spec_rounds: int = 0  # lane-rounds of MTP speculation
    drafts_verified: int = 0
    drafts_accepted: int = 0


class ModelEngine:
    """Runs prefill, decode and MTP rounds for batches of :class:`Lane` through a :class:`KVStore`.

    Args:
      steps: the jitted steps (their ``StepConfig`` fixes model, profile, impl, chunk, K, buckets).
      params: model parameters.
      store: the KV store whose pools the steps read and write (Main, plus MTP with that backend).
      fingerprint: :func:`model_fingerprint` stamped on state images.
    """

    def __init__(self, steps: ModelSteps, params: dict, store: KVStore, fingerprint: str):
        self.steps = steps
        self.params = params
        self.store = store
        self.fingerprint = fingerprint
        cfg = steps.config
        self.model = cfg.model
        self.chunk = cfg.prefill_chunk
        self.draft_window = cfg.draft_window
        self.buckets = cfg.batch_buckets
        self.mtp = MTP in store.pool_kinds
        if self.mtp and not self.model.mtp:
            raise ValueError("the store has an MTP pool but the model has no MTP head (ModelConfig(mtp=True))")
        if max(self.buckets) < store.max_concurrency:
            raise ValueError(
                f"the largest batch bucket {max(self.buckets)} is below max_concurrency={store.max_concurrency}"
            )
        self.stats = UnitStats()
        self.state: KVDeviceState = self._allocate_state()
        self.work_shape = step_work_shape(store)

    def _allocate_state(self) -> KVDeviceState:
        return self.store.allocate_state()

    def _step_work(self):
        """The round work for the next step, padded to :attr:`work_shape` (an oversized one is
        applied alone first)."""
        self.state, work = take_step_work(self.store, self.state, self.work_shape)
        return work

    def flushed_state(self) -> KVDeviceState:
        """The device state with every pending round work applied (for an offload's gather)."""
        if any(not p.empty for p in self.store.pending_work().values()):
            self.state = apply_work_jit(self.state, self.store.take_work())
        return self.state

    # -- plumbing ----------------------------------------------------------------------------------
    def _call(self, name: str, kind: PoolKind, lead, positions, valid, rows, next_tokens=None):
        """Run state step ``name`` (the round work applied first) on pool ``kind`` for ``n`` rows padded
        to a bucket.

        ``lead`` is int32 tokens ``(n, T)`` (Main steps) or float32 hidden states ``(n, T, d)`` with
        ``next_tokens (n, T)`` (MTP steps).  Returns the step's output.
        """
        n = len(rows)
        bucket = bucket_for(n, self.buckets)
        self.stats.units[name] = self.stats.units.get(name, 0) + 1
        self.stats.buckets.setdefault(name, set()).add(bucket)
        if next_tokens is None:
            padded = pad_rows(lead, positions, valid, rows, bucket=bucket)
            args = (padded.tokens,)
        else:
            padded = pad_rows(next_tokens, positions, valid, rows, bucket=bucket)
            hidden = np.zeros((bucket,) + lead.shape[1:], np.float32)
            hidden[:n] = lead
            args = (jnp.asarray(hidden, self.model.jnp_dtype), padded.tokens)
        work = self._step_work()
        self.state, out = self.steps.on_state(name)(
            self.params, self.state, work, *args, padded.positions, padded.valid, padded.table_rows
        )
        return out

    @staticmethod
    def _rows(lanes: Sequence[Lane]) -> np.ndarray:
        return np.array([lane.row for lane in lanes], np.int64)

    # -- MTP pairs -----------------------------------------------------------------------------------
    def _pairs(self, lane: Lane, limit: int) -> int:
        """MTP pairs of ``lane`` to write after a prefill chunk (next token known), at most ``limit``.

        A lane that starts decoding keeps its last pair pending: the first MTP round extends it and
        drafts from its output.
        """
        ready = min(lane.frontier, len(lane.tokens) - 1) - lane.mtp_frontier
        if not lane.prefix_job and not lane.prefilling:
            ready -= 1
        return max(0, min(ready, limit))

    def _extend_mtp(self, lanes: Sequence[Lane]) -> None:
        """Write every ready MTP pair (up to one chunk per lane) with the ``mtp_extend`` step."""
        t = self.chunk
        counts = [self._pairs(lane, t) for lane in lanes]
        todo = [(lane, c) for lane, c in zip(lanes, counts) if c > 0]
        if not todo:
            return
        d = self.model.d_model
        n = len(todo)
        hidden = np.zeros((n, t, d), np.float32)
        nxt = np.zeros((n, t), np.int32)
        pos = np.zeros(n, np.int32)
        valid = np.zeros(n, np.int32)
        for i, (lane, c) in enumerate(todo):
            hidden[i, :c] = lane.hidden_tail[:c]
            nxt[i, :c] = lane.tokens[lane.mtp_frontier + 1 : lane.mtp_frontier + 1 + c]
            pos[i], valid[i] = lane.mtp_frontier, c
        rows = self._rows([lane for lane, _ in todo])
        self.store.map_rows(rows, pos.astype(np.int64) + valid, pool=MTP)
        self._call("mtp_extend", MTP, hidden, pos, valid, rows, next_tokens=nxt)
        self.store.commit_rows(rows, pos.astype(np.int64) + valid, pool=MTP)
        for i, (lane, c) in enumerate(todo):
            lane.mtp_frontier += c
            lane.hidden_tail = lane.hidden_tail[c:]

    # -- units ------------------------------------------------------------------------------------------
    def prefill(self, lanes: Sequence[Lane]) -> None:
        """One chunk of chunked prefill for every lane (``frontier < prefill_end``).

        A lane whose prompt completes generates its first token (prefix jobs generate nothing).
        """
        if not lanes:
            return
        n, t = len(lanes), self.chunk
        tokens = np.zeros((n, t), np.int32)
        pos = np.zeros(n, np.int32)
        valid = np.zeros(n, np.int32)
        for i, lane in enumerate(lanes):
            v = min(t, lane.prefill_end - lane.frontier)
            tokens[i, :v] = lane.tokens[lane.frontier : lane.frontier + v]
            pos[i], valid[i] = lane.frontier, v
        rows = self._rows(lanes)
        ends = pos.astype(np.int64) + valid
        self.store.map_rows(rows, ends)
        out = self._call("prefill", MAIN, tokens, pos, valid, rows)
        self.store.commit_rows(rows, ends)
        self.stats.prefill_tokens += int(valid.sum())
        next_tokens = np.asarray(out.next_tokens)
        logits = np.asarray(out.logits) if any(not l.prefix_job for l in lanes) else None
        hidden = np.asarray(out.hidden, np.float32) if self.mtp else None
        for i, lane in enumerate(lanes):
            lane.frontier = int(ends[i])
            if self.mtp:
                lane.hidden_tail = np.concatenate([lane.hidden_tail, hidden[i, : valid[i]]])
            if not lane.prefix_job and lane.frontier == lane.prefill_end:
                lane.tokens.append(int(next_tokens[i]))
                lane.generated_logits.append(logits[i].copy())
        if self.mtp:
            self._extend_mtp(lanes)

    def decode(self, lanes: Sequence[Lane]) -> None:
        """One decode step (one token) per lane."""
        if not lanes:
            return
        n = len(lanes)
        tokens = np.array([[lane.tokens[-1]] for lane in lanes], np.int32)
        pos = np.array([lane.frontier for lane in lanes], np.int32)
        valid = np.ones(n, np.int32)
        rows = self._rows(lanes)
        ends = pos.astype(np.int64) + 1
        self.store.map_rows(rows, ends)
        out = self._call("decode", MAIN, tokens, pos, valid, rows)
        self.store.commit_rows(rows, ends)
        next_tokens = np.asarray(out.next_tokens)
        logits = np.asarray(out.logits)
        for i, lane in enumerate(lanes):
            lane.frontier += 1
            lane.tokens.append(int(next_tokens[i]))
            lane.generated_logits.append(logits[i].copy())
        self.stats.decode_tokens += n

    def speculate(self, lanes: Sequence[Lane], limits: Sequence[int]) -> None:
        """One MTP round per lane: draft ``K`` tokens, verify ``min(K + 1, limit)`` of them, settle.

        ``limits[i] >= 1`` bounds the tokens lane ``i`` may produce this round (remaining budget,
        or the frontier its lease covers).
        """
        if not lanes:
            return
        k = self.draft_window
        n, d = len(lanes), self.model.d_model
        rows = self._rows(lanes)
        # -- draft: extend the pending pairs, then K recursive MTP steps ----------------------------
        hidden = np.zeros((n, k + 1, d), np.float32)
        nxt = np.zeros((n, k + 1), np.int32)
        mpos = np.zeros(n, np.int32)
        mvalid = np.zeros(n, np.int32)
        for i, lane in enumerate(lanes):
            c = lane.frontier - lane.mtp_frontier
            if not 1 <= c <= k + 1 or len(lane.tokens) != lane.frontier + 1:
                raise AssertionError(f"lane {lane.request.id}: {c} pending MTP pairs, expected 1..{k + 1}")
            hidden[i, :c] = lane.hidden_tail
            nxt[i, :c] = lane.tokens[lane.mtp_frontier + 1 : lane.frontier + 1]
            mpos[i], mvalid[i] = lane.mtp_frontier, c
        front = np.array([lane.frontier for lane in lanes], np.int64)
        self.store.map_rows(rows, front + (k - 1), pool=MTP)  # the provisional lead of K - 1 drafts
        drafted = self._call("mtp_draft", MTP, hidden, mpos, mvalid, rows, next_tokens=nxt)
        self.store.commit_rows(rows, front, pool=MTP)  # the pending pairs are canonical
        drafts = np.asarray(drafted.drafts)
        # -- verify: (t_n, d_1 .. d_K) at positions n .. n + K ---------------------------------------
        tokens = np.zeros((n, k + 1), np.int32)
        vvalid = np.zeros(n, np.int32)
        for i, lane in enumerate(lanes):
            tokens[i, 0] = lane.tokens[-1]
            tokens[i, 1:] = drafts[i]
            vvalid[i] = min(k + 1, int(limits[i]))
            if vvalid[i] < 1:
                raise ValueError(f"lane {lane.request.id}: limit {limits[i]} leaves no token to produce")
        self.store.map_rows(rows, front + vvalid)
        out = self._call("verify", MAIN, tokens, front.astype(np.int32), vvalid, rows)
        accepted = np.asarray(out.num_accepted)[:n].astype(np.int64)
        target = np.asarray(out.target_tokens)
        logits = np.asarray(out.logits)
        vhidden = np.asarray(out.hidden, np.float32)
        # -- settle both pools: commit what was accepted, trim the rejected tails -------------------
        self.store.settle_rows(rows, front + accepted + 1)
        self.store.settle_rows(rows, front, pool=MTP)
        for i, lane in enumerate(lanes):
            a = int(accepted[i])
            kept = [int(x) for x in target[i, : a + 1]]
            stops = [j for j, x in enumerate(kept) if x in lane.request.stop_tokens]
            kept = kept[: stops[0] + 1] if stops else kept  # nothing after a stop token
            lane.tokens.extend(kept)
            lane.generated_logits.extend(logits[i, j].copy() for j in range(len(kept)))
            lane.hidden_tail = vhidden[i, : a + 1].copy()  # h_n .. h_{n+a}: the next round's pending pairs
            lane.mtp_frontier = lane.frontier
            lane.frontier += a + 1
        st = self.stats
        st.spec_rounds += n
        st.drafts_verified += int((vvalid - 1).sum())
        st.drafts_accepted += int(accepted.sum())
        st.decode_tokens += int((accepted + 1).sum())

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_image(self, lane: Lane) -> tuple[StateImage, dict]:
        """The :class:`StateImage` and ``frontiers`` of a completed prefix job (for ``finish(retain=True)``)."""
        frontiers = {MAIN: lane.frontier}
        hidden = None
        if self.mtp:
            frontiers[MTP] = lane.mtp_frontier
            if lane.mtp_frontier != lane.frontier - 1 or lane.hidden_tail.shape[0] != 1:
                raise AssertionError(
                    f"prefix job {lane.request.id}: MTP frontier {lane.mtp_frontier} with {lane.hidden_tail.shape[0]} "
                    f"pending states at Main frontier {lane.frontier}"
                )
            hidden = np.array(lane.hidden_tail[0], np.float32)
            hidden.flags.writeable = False
        image = StateImage(self.fingerprint, {k.value: v for k, v in frontiers.items()}, hidden)
        return image, frontiers

    def resume(self, lane: Lane, image: StateImage) -> None:
        """Position a lane forked from a checkpoint with ``image`` at the checkpoint's frontiers."""
        if image.model != self.fingerprint:
            raise ValueError(f"state image of model {image.model} cannot resume on model {self.fingerprint}")
        lane.frontier = int(image.frontiers["main"])
        if self.mtp:
            lane.mtp_frontier = int(image.frontiers["mtp"])
            lane.hidden_tail = image.hidden[None, :].copy()

    def new_hidden_tail(self) -> np.ndarray | None:
        return np.zeros((0, self.model.d_model), np.float32) if self.mtp else None
