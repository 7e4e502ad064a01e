"""Running the engine's units: one model call for a batch of sequences, on one device.

A round of :class:`~ninfer_kv.engine.core.EngineCore` is a generator that *yields* each unit it
needs as a :class:`UnitCall` (unpadded: ``n`` real rows) and receives the step's output back; the
runner pads the call to a batch bucket, takes the store's round work, runs the model and returns
the output (or raises, and the round fails that unit's requests).  Keeping the call out of the round
lets one driver serve a single device (:class:`DeviceRunner`, :func:`drive`) and another merge the
units of several data shards into one mesh step (:mod:`ninfer_kv.engine.data_parallel`).
"""

from __future__ import annotations

import dataclasses
from typing import Generator, NamedTuple

import numpy as np

from ..device.allocation import allocate_state
from ..device.offload_gather import offload_checkpoint
from ..device.rounds import take_step_work
from ..device.resync import resync
from ..device.ring_snapshots import RingImage, copy_ring
from ..device.work import apply_work_jit
from ..models.decoder.padding import pad_ragged, pad_rows
from ..schema.buckets import bucket_for
from ..models.decoder.sampling import GREEDY, sampling_rows
from ..store import KVStore

__all__ = ["UnitCall", "DeviceRunner", "UnitLog", "drive", "KINDS"]

KINDS = ("prefill", "decode", "verify", "mtp_extend", "mtp_draft", "ragged")
"""The model calls a round can make (``verify`` and the MTP calls only with a speculative model;
``ragged``, a ragged batch, only on a runner and model that run it)."""


class UnitCall(NamedTuple):
    """One unit of a round, before padding.

    Attributes:
      kind: one of :data:`KINDS`; the model method called.
      tokens: int32 ``(n, T)``: input tokens (for the MTP calls, the token after each hidden state);
        for ``ragged``, int32 ``(sum(valid),)``: the rows' tokens one after another.
      positions, valid: int32 ``(n,)`` (for ``ragged``, ``valid`` is each row's token count).
      rows: int64 ``(n,)`` execution rows of the store that the round runs over.
      sampling: each row's :class:`~ninfer_kv.models.decoder.sampling.SamplingConfig`, or ``None``
        when every row is greedy.
      hidden: float32 ``(n, T, d)`` main hidden states (MTP calls only).
    """

    kind: str
    tokens: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    rows: np.ndarray
    sampling: list | None = None
    hidden: np.ndarray | None = None


@dataclasses.dataclass
class UnitLog:
    """Model calls run, by kind, and the shapes each kind ran in: its batch buckets, and for
    ``ragged`` units ``(batch bucket, token bucket)`` pairs."""

    units: dict = dataclasses.field(default_factory=dict)
    buckets: dict = dataclasses.field(default_factory=dict)

    def record(self, kind: str, bucket: "int | tuple[int, int]") -> None:
        self.units[kind] = self.units.get(kind, 0) + 1
        shape = tuple(int(b) for b in bucket) if isinstance(bucket, tuple) else int(bucket)
        self.buckets.setdefault(kind, set()).add(shape)


def call_model(model, kind: str, state, work, tokens, positions, valid, table_rows, sampling, hidden):
    """``model.<kind>(state, work, ...)`` with the arguments that kind takes (for ``ragged``,
    ``valid`` is the rows' ``query_starts``)."""
    if kind in ("mtp_extend", "mtp_draft"):
        return getattr(model, kind)(state, work, hidden, tokens, positions, valid, table_rows)
    return getattr(model, kind)(state, work, tokens, positions, valid, table_rows, sampling)


class DeviceRunner:
    """Runs units on one device over one store; owns the :class:`~ninfer_kv.KVDeviceState`.

    Args:
      model: the engine's model (prepared here for the store's Main layout and ``buckets``).
      store: the store.
      buckets: batch sizes a unit is padded to.
      token_buckets: token counts a ``ragged`` unit is padded to, or ``None`` when this runner
        runs no ragged units (:attr:`runs_ragged`); only with a model that has a ``ragged`` call.
    """

    def __init__(self, model, store: KVStore, buckets: tuple[int, ...], token_buckets: tuple[int, ...] | None = None):
        self.model = model
        self.store = store
        self.buckets = tuple(buckets)
        self.token_buckets = tuple(token_buckets) if token_buckets else None
        if self.token_buckets is not None:
            model.prepare(store.layout("main"), self.buckets, token_buckets=self.token_buckets)
        else:
            model.prepare(store.layout("main"), self.buckets)
        self.state = allocate_state(store)
        self.log = UnitLog()

    @property
    def runs_ragged(self) -> bool:
        """Whether :meth:`run` takes ``ragged`` units (ragged batches)."""
        return self.token_buckets is not None

    def run(self, call: UnitCall):
        """Pad ``call`` to a bucket, apply the pending round work inside the step, run the model;
        returns the model's output with ``n`` meaningful rows."""
        bucket = bucket_for(len(call.rows), self.buckets)
        if call.kind == "ragged":
            ragged = pad_ragged(call.tokens, call.valid, call.positions, call.rows, bucket=bucket,
                                token_bucket=bucket_for(max(int(call.tokens.size), 1), self.token_buckets))
            padded = (ragged.tokens, ragged.positions, ragged.query_starts, ragged.table_rows)
            self.log.record(call.kind, (bucket, ragged.tokens.size))
        else:
            rect = pad_rows(call.tokens, call.positions, call.valid, call.rows, bucket=bucket)
            padded = (rect.tokens, rect.positions, rect.valid, rect.table_rows)
            self.log.record(call.kind, bucket)
        sampling = None
        if call.sampling is not None:
            sampling = sampling_rows([c if c is not None else GREEDY for c in call.sampling], bucket)
        hidden = None
        if call.hidden is not None:
            hidden = np.zeros((bucket,) + call.hidden.shape[1:], np.float32)
            hidden[: len(call.rows)] = call.hidden
        self.state, work = take_step_work(self.store, self.state)
        self.state, out = call_model(self.model, call.kind, self.state, work, *padded, sampling, hidden)
        return out

    def copy_ring(self, src: int, dst: int) -> None:
        """Copy window ring ``src`` onto ring ``dst`` in the device state (a row's ring to a snapshot
        slot or back: :func:`~ninfer_kv.device.ring_snapshots.copy_ring`)."""
        self.state = copy_ring(self.state, src, dst)

    def flushed_state(self):
        """The device state with every pending round work applied (an offload's source)."""
        if any(not p.empty for p in self.store.pending_work().values()):
            self.state = apply_work_jit(self.state, self.store.take_work())
        return self.state

    def offload_checkpoint(self, checkpoint):
        """Move a retained checkpoint's pages to the store's Host tier, from the flushed state."""
        return offload_checkpoint(self.store, checkpoint, self.flushed_state())

    def repair(self) -> tuple[set, set]:
        """After a failed step: bring the state back in line with the store (a blank one when the
        step consumed it); returns the sequences and checkpoints whose content is lost.  A blank
        state's window rings hold nothing: then every active sequence and every checkpoint holding a
        ring snapshot is lost too (no Host replica holds a ring)."""
        fresh = consumed(self.state)
        if fresh:
            self.state = allocate_state(self.store)
        self.state, report = resync(self.store, self.state)
        lost_sequences, lost_checkpoints = set(report.lost_sequences), set(report.lost_checkpoints)
        if fresh and self.state.ring is not None:
            lost_sequences |= set(self.store.sequences())
            lost_checkpoints |= {h for h in self.store.checkpoints()
                                 if isinstance(self.store.checkpoint(h).state_image, RingImage)}
        return lost_sequences, lost_checkpoints


def consumed(state) -> bool:
    """Whether a step consumed ``state`` (its buffers were donated or deleted)."""
    sync = getattr(state, "sync", None)
    return sync is not None and hasattr(sync, "is_deleted") and sync.is_deleted()


def drive(round_: Generator, run):
    """Run one round generator to its end, each yielded unit through ``run(call)``; a unit that
    raises is thrown back into the round (which fails that unit's requests).  Returns the round's
    value."""
    try:
        call = next(round_)
        while True:
            try:
                out = run(call)
            except Exception as exc:  # noqa: BLE001 - the round decides whose requests fail
                call = round_.throw(exc)
            else:
                call = round_.send(out)
    except StopIteration as stop:
        return stop.value
