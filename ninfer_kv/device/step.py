"""The step API: the short way to put the paged cache under your own jitted step.

A step is three calls, and the jitted part sees one pytree of metadata::

    state, batch = begin_step(store, state, sequences, num_tokens)   # host: map pages, take the work
    state, out = step(state, batch, tokens)                           # your jax.jit, state donated
    end_step(store, batch)                                            # host: commit, after the step

and inside ``step``, one call per layer::

    state, out = attention(state, batch, layer, q, k, v)              # append k, v; attend with q

* :func:`begin_step` makes each sequence's pages cover its new tokens (``store.map``), takes the
  store's round work in the step's fixed shape (:func:`~ninfer_kv.device.rounds.take_step_work`)
  and returns an :class:`AttentionBatch`: the execution rows, the position of each row's first new
  token (its committed frontier), the number of new tokens per row and the round work.  The state
  it returns carries the work-pending mark.
* :func:`attention` is the per-layer call inside the step.  The first call of a trace applies the
  batch's round work (:func:`~ninfer_kv.device.work.apply_work`, which clears the mark), so every
  later call sees tables and planes up to date; then it appends ``k, v (B, T, H, D)`` for tokens
  ``t < num_tokens[b]`` at ``positions[b] + t`` and returns causal attention of ``q (B, T, Hq, D)``
  over each row's ``positions[b] + num_tokens[b]`` tokens, with the state whose planes hold the
  new tokens.
* :func:`end_step` commits the new tokens (``store.commit``) once the step has returned.

The protocol's guarantees hold as in the full form (``take_step_work`` / ``apply_work`` /
``ninfer_kv.ops`` by hand, docs/API.md): the state is donated, a step is one dispatch per unit (two
when a large work, such as a fork's copy-on-write, is applied alone first), page IDs never reach a
graph key, and a caller's slip is loud: a donated state raises
:class:`~ninfer_kv.schema.errors.DonatedStateError`, a step that reads the planes before the work
is applied :class:`~ninfer_kv.schema.errors.PendingWorkError`, a skipped or repeated work poisons
the state (:meth:`KVStore.require_synced <ninfer_kv.store.KVStore.require_synced>` says so), and
:func:`end_step` refuses a batch that was already committed or is older than the rows' frontiers.

One pool and one device: a sharded store runs the full protocol inside ``shard_map``
(``examples/sharded_step.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .. import ops
from ..schema.errors import WorkOrderError
from ..schema.kinds import PoolKind
from ..schema.round_work import RoundWork
from .rounds import take_step_work
from .state import KVDeviceState
from .work import apply_work

__all__ = ["AttentionBatch", "begin_step", "attention", "end_step"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """One unit's attention metadata, built on the host by :func:`begin_step` (a pytree: the arrays
    are leaves, the pool is static).

    Host-side the arrays are numpy; passed to a jitted step they become its traced arguments, so
    the step compiles once per batch shape ``B`` and work shape, whatever pages the rows hold.
    """

    work: RoundWork
    """The store's round work since the last unit, padded to the step's fixed shape."""
    rows: jax.Array
    """``int32 (B,)``: each sequence's execution row (its block-table row)."""
    positions: jax.Array
    """``int32 (B,)``: the position of each row's first new token (its committed frontier)."""
    num_tokens: jax.Array
    """``int32 (B,)``: new tokens per row this unit (``0 <= num_tokens[b] <= T``)."""
    pool: PoolKind = dataclasses.field(default=PoolKind.MAIN, metadata=dict(static=True))
    """The pool the step appends to and attends over."""

    @property
    def kv_lens(self):
        """Tokens each row attends over after this unit: ``positions + num_tokens``."""
        return self.positions + self.num_tokens


def begin_step(store, state: KVDeviceState, sequences, num_tokens, *, pool=PoolKind.MAIN,
               shapes=None) -> tuple[KVDeviceState, AttentionBatch]:
    """Prepare one unit of a jitted step: pages for every new token, the round work, the batch.

    ``sequences``: the sequence handles of the batch's rows, in batch order (or their execution
    rows, ``store.row(handle)``); ``num_tokens``: the new tokens of each (one integer for all, or
    one per sequence), which the step's token batch ``(B, T)`` must hold (``T >= max(num_tokens)``).
    ``shapes``: the step's work shapes (:func:`~ninfer_kv.device.rounds.take_step_work`; default
    the store's).

    Returns ``(state, batch)``: pass both to the step.  The state carries the work-pending mark
    (the first :func:`attention` of the step applies the batch's work).

    Raises, before anything changes: ``ValueError`` for an empty batch, a length mismatch or a
    negative count; the store's errors for an unknown handle or row (``StaleHandleError``,
    ``RowError``) and for new tokens beyond a sequence's reservation (``EntitlementError``,
    ``TargetError``); ``PendingWorkError`` when ``state`` still carries the mark of a batch whose
    step never ran; ``DonatedStateError`` for a donated state.
    """
    if hasattr(store, "kv_mesh"):
        raise TypeError("begin_step takes a single-device KVStore; a ShardedKVStore runs the full protocol "
                        "inside shard_map (examples/sharded_step.py)")
    kind = PoolKind.parse(pool)
    rows = _rows(store, sequences)
    counts = np.broadcast_to(np.asarray(num_tokens), rows.shape) if np.ndim(num_tokens) == 0 else np.asarray(num_tokens)
    if counts.shape != rows.shape or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"num_tokens must be one integer or {rows.size} integers (one per sequence), got "
                         f"{np.asarray(num_tokens).dtype} of shape {np.shape(num_tokens)}")
    if (counts < 0).any():
        raise ValueError(f"num_tokens must be >= 0, got {counts.tolist()}")
    rings = store.pool_set.rings
    if rings is not None and (counts > rings.spec.step_tokens).any():
        raise ValueError(f"num_tokens={counts.tolist()} exceeds the window rings' step_tokens="
                         f"{rings.spec.step_tokens}: a row may write at most that many tokens per step (a ring "
                         f"holds its window plus one step); split the tokens over more steps")
    positions = _committed(store, rows, kind)
    frontiers = positions + counts.astype(np.int64)
    store.check_map(rows, frontiers, pool=kind)   # refuse before the state is touched
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    store.map(rows, frontiers, pool=kind)
    state, work = take_step_work(store, state, shapes)
    batch = AttentionBatch(work, rows.astype(np.int32), positions.astype(np.int32), counts.astype(np.int32), kind)
    return state, batch


def attention(state: KVDeviceState, batch: AttentionBatch, layer, q, k, v, *, sm_scale: float | None = None,
              window: int | None = None, soft_cap: float | None = None, sinks=None, ring: bool = False,
              impl: str = "auto") -> tuple[KVDeviceState, jax.Array]:
    """One layer's append and attention over the paged cache, inside the caller's jitted step.

    ``layer``: a Python int (or a traced integer scalar, e.g. in a ``lax.scan`` over layers);
    ``q (B, T, Hq, D)``, ``k, v (B, T, H, D)`` with ``Hq`` a multiple of the pool's ``H`` KV
    heads and ``B`` the batch's rows.  Appends tokens ``t < batch.num_tokens[b]`` at
    ``batch.positions[b] + t`` and returns ``(state, out)``: the state with the new tokens in its
    planes, and causal GQA attention ``out (B, T, Hq, D)`` (rows of padding tokens are not
    meaningful).  The first call of a step applies the batch's round work.  ``sm_scale`` (static,
    default ``1 / sqrt(D)``), the layer's ``window``, ``soft_cap`` and ``sinks``, and ``impl`` as
    :func:`ninfer_kv.ops.paged_attention`.

    ``ring=True``: ``layer`` is a layer of the window rings (``ModelKVConfig(rings=WindowRings(...))``,
    :mod:`ninfer_kv.planning.rings`), which keep only each row's window: ``window`` is then required
    and at most the rings' window (``ValueError`` otherwise).
    """
    if not isinstance(batch, AttentionBatch):
        raise TypeError(f"batch must be the AttentionBatch of begin_step, got {type(batch).__name__}")
    if ring:
        spec = state.ring.spec if state.ring is not None else None
        if spec is None:
            raise ValueError("ring=True needs a state with window rings (ModelKVConfig(rings=WindowRings(...)))")
        if window is None or isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= spec.window:
            raise ValueError(f"window={window!r}: a ring layer needs a window in [1, {spec.window}] (the rings' window)")
    if state.work_pending:  # the first layer of the step: apply the unit's work once
        state = apply_work(state, batch.work)
    view = state.ring_view(layer) if ring else state.view(batch.pool, layer)
    view = ops.paged_append(view, batch.rows, batch.positions, k, v, batch.num_tokens, impl=impl)
    out = ops.paged_attention(q, view, batch.rows, batch.positions, batch.kv_lens, sm_scale=sm_scale, window=window,
                              soft_cap=soft_cap, sinks=sinks, impl=impl)
    if ring:
        return state.replace_rings(view.planes), out
    return state.replace_planes(batch.pool, view.planes), out


def end_step(store, batch: AttentionBatch) -> None:
    """Commit the unit's new tokens (``store.commit``), once its step has returned.

    Raises ``WorkOrderError``, committing nothing, when a row's committed frontier is no longer
    the batch's position (the batch was already committed, or a later one was): the tokens of a
    repeated or stale batch are not committed twice.
    """
    if not isinstance(batch, AttentionBatch):
        raise TypeError(f"batch must be the AttentionBatch of begin_step, got {type(batch).__name__}")
    rows, positions = np.asarray(batch.rows), np.asarray(batch.positions)
    now = _committed(store, rows, batch.pool)
    moved = np.flatnonzero(now != positions)
    if moved.size:
        i = int(moved[0])
        raise WorkOrderError(
            f"end_step: execution row {int(rows[i])} is committed to {int(now[i])} tokens, the batch began at "
            f"{int(positions[i])}: this batch was already committed (or a later one was); call end_step once per "
            f"begin_step, in order")
    store.commit(rows, positions + np.asarray(batch.num_tokens), pool=batch.pool)


def _rows(store, sequences) -> np.ndarray:
    """Execution rows of ``sequences`` (handles or rows), as an int64 vector."""
    items = sequences.tolist() if isinstance(sequences, np.ndarray) else list(sequences)
    if not items:
        raise ValueError("begin_step needs at least one sequence")
    rows = [x if isinstance(x, (int, np.integer)) and not isinstance(x, bool) else store.row(x) for x in items]
    return store.check_rows(np.array(rows, np.int64))


def _committed(store, rows: np.ndarray, pool: PoolKind) -> np.ndarray:
    """Each execution row's committed frontier in ``pool``."""
    return np.asarray(store.committed_frontiers(rows, pool=pool), np.int64)

