"""Buckets: every ladder of padded sizes of the package, and the step-work shapes built from them.

A jitted program compiles once per input shape, so every variable-length input is padded to the
smallest *bucket* of a short ladder that holds it (:func:`bucket`).  This module is the one home of
those ladders (numpy only, no JAX):

* :func:`ladder_rungs`, the one geometric ladder, and :func:`ladder` (with a zero bucket) for the
  buffers of a round work;
* :func:`bucket_ladder` and :data:`DEFAULT_BATCH_BUCKETS`: the batch sizes of the decoder's steps,
  and :func:`bucket_for` to pick one;
* :func:`token_ladder`: the token counts of a ragged round, up to ``max_num_batched_tokens``
  (:data:`DEFAULT_MAX_NUM_BATCHED_TOKENS` unless the caller says otherwise,
  :func:`resolve_max_num_batched_tokens`);
* :class:`StepWorkShapes`: the step and alone shapes of the works a serving loop applies.

**Step-work shapes.**  Every jitted program that applies a :class:`~ninfer_kv.schema.round_work.RoundWork` compiles once per shape of the
work's buffers ``(table updates, copies, restores)``.  A serving loop therefore fixes

* the **step shape**: the work its step applies every round, padded to one shape (one compile of
  the step), and
* a short ladder of **alone shapes**: a work too large for the step (table rows of a burst of
  activations, COW copies of forks, Host restores) is padded to the smallest alone shape that holds
  it and applied by :func:`~ninfer_kv.device.work.apply_work_jit` before the step, whose own work is then the
  next, empty, take.

So the loop compiles at most ``1 + len(alone)`` work-applying programs (:attr:`StepWorkShapes.programs`),
whatever the rounds do.  The trade-off is padding against compiles: each buffer entry costs work
(a scatter's cost grows with its buffer on a CPU, and on XLA's CPU compiler page writes inside a
step copy the float planes they write), so the step shape holds what a decode round needs (table
entries for the lanes crossing a page boundary) and, by default, no copies or restores; the alone
ladder grows by ``factor`` (8) per rung, so a padded alone work is at most 8 times its natural
size.  docs/API.md ("Step-work shapes") gives measured costs.
"""

from __future__ import annotations

import dataclasses

from .integers import check_int

__all__ = ["StepWorkShapes", "step_work_shapes", "step_work_shape", "ladder_rungs", "ladder", "bucket",
           "bucket_ladder", "token_ladder", "bucket_for", "DEFAULT_BATCH_BUCKETS", "DEFAULT_MAX_NUM_BATCHED_TOKENS",
           "MAX_NUM_BATCHED_TOKENS_LIMIT", "resolve_max_num_batched_tokens"]

Shape = tuple[int, int, int]

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Batch sizes the step functions are compiled for unless told otherwise (``bucket_ladder(32)``);
smaller batches are padded up to a bucket."""

DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
"""Tokens one ragged round feeds at most (decodes first, then prompt tokens in arrival order) unless
``max_num_batched_tokens`` says otherwise; raised to the rows when there are more
(:func:`resolve_max_num_batched_tokens`).  Larger rounds do not make the products faster on a CPU
(their rate falls past about 512 rows) and hold every decode back for longer; docs/PERFORMANCE.md
has the figures."""

MAX_NUM_BATCHED_TOKENS_LIMIT = 1 << 20
"""The largest ``max_num_batched_tokens`` accepted."""


@dataclasses.dataclass(frozen=True)
class StepWorkShapes:
    """The work shapes of one serving loop.

    Attributes:
      step: ``(table updates, copies, restores)`` of the work every step applies.
      alone: ascending shapes for works applied alone; the last holds any work of the store.
    """

    step: Shape
    alone: tuple[Shape, ...]

    @property
    def programs(self) -> int:
        """Work-applying programs the loop compiles at most: the step plus one per alone shape."""
        return 1 + len(self.alone)

    def alone_shape(self, counts) -> Shape:
        """The smallest alone shape holding a work of ``counts`` (``RoundWork.counts()`` values:
        ``(tables, copies, restores)`` per pool)."""
        need = [max(c[i] for c in counts) for i in range(3)] if counts else [0, 0, 0]
        for shape in self.alone:
            if all(n <= s for n, s in zip(need, shape)):
                return shape
        raise ValueError(f"a work of sizes {tuple(need)} exceeds the largest alone shape {self.alone[-1]}")


def ladder_rungs(first: int, factor: int, cap: int) -> list[int]:
    """``first, first * factor, first * factor**2, ...`` below ``cap``, then ``cap`` itself.

    The one geometric ladder of the package (``first >= 1``, ``factor >= 2``): the alone shapes of
    :func:`step_work_shapes`, the store's buffer buckets (:func:`ladder`) and the batch buckets
    (:func:`bucket_ladder`).
    """
    out, n = [], first
    while n < cap:
        out.append(n)
        n *= factor
    out.append(cap)
    return out


def step_work_shapes(
    store, *, tables: int | None = None, copies: int = 0, restores: int = 0, factor: int = 8
) -> StepWorkShapes:
    """The step shape and alone ladder for ``store`` (a :class:`KVStore`, or one shard's).

    Args:
      tables: table entries in the step's work (default: half the execution rows, at least 64 — a
        decode round maps a page only for the lanes crossing a page boundary, about one in 64).
      copies, restores: COW copies and Host restores in the step's work (default 0: forks and
        restores are applied alone; on an accelerator a few in the step save that dispatch).
      factor: growth of the alone ladder (every dimension grows by it per rung, up to the store's
        capacity: ``C * L`` table entries, ``N`` pages).

    Returns:
      :class:`StepWorkShapes` with at most ``1 + ceil(log_factor(max(C * L / tables, N / 8)))``
      alone rungs.
    """
    cap = store.max_concurrency * store.logical_pages
    pages = max(store.pool(k).capacity for k in store.pool_kinds)
    t = min(cap, max(64, store.max_concurrency // 2)) if tables is None else min(cap, int(tables))
    step = (t, min(int(copies), pages), min(int(restores), pages))
    t_rungs = ladder_rungs(max(int(t * factor), 1), factor, cap)
    p_rungs = ladder_rungs(max(8, step[1], step[2]), factor, pages)
    n = max(len(t_rungs), len(p_rungs))
    alone = tuple(
        (t_rungs[min(i, len(t_rungs) - 1)], p_rungs[min(i, len(p_rungs) - 1)], p_rungs[min(i, len(p_rungs) - 1)])
        for i in range(n)
    )
    return StepWorkShapes(step=step, alone=alone)


def step_work_shape(store) -> Shape:
    """The default step shape of :func:`step_work_shapes` (table entries of half the rows, at least
    64; no copies, no restores)."""
    return step_work_shapes(store).step


def ladder(first: int, factor: int, cap: int) -> tuple[int, ...]:
    """Bucket sizes ``0, first, first * factor, ...`` up to and including ``cap``: every
    variable-length part of a round work (table updates, COW copies, Host restores, offload page
    lists) is padded to the smallest bucket of such a ladder, so a jitted step sees one shape per
    bucket, never one per length."""
    return tuple(sorted({0, *ladder_rungs(first, factor, max(cap, 0))}))


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n`` entries."""
    for b in sizes:
        if n <= b:
            return b
    raise ValueError(f"{n} entries exceed the largest bucket {sizes[-1]}")


def bucket_ladder(largest: int, factor: int = 2) -> tuple[int, ...]:
    """Batch buckets ``1, factor, factor**2, ...`` below ``largest``, then ``largest`` itself."""
    largest = check_int("largest", largest, 1)
    factor = check_int("factor", factor, 2)
    return tuple(ladder_rungs(1, factor, largest))


def token_ladder(largest: int, steps_per_octave: int = 8) -> tuple[int, ...]:
    """Token buckets of the ragged step up to ``largest``: 16, 32, 64, 128, then ``steps_per_octave``
    evenly spaced sizes per doubling (144, 160, ..., 256, 288, ... with 8), then ``largest``.

    Padding tokens cost what real ones cost in the products, so above 128 tokens the ladder is
    finer than doubling: at most ``1 / steps_per_octave`` of a round is padding, while the number
    of compiled shapes grows only with the logarithm of ``largest``.
    """
    largest = check_int("largest", largest, 1)
    steps_per_octave = check_int("steps_per_octave", steps_per_octave, 1, 64)
    out, n = [], 16
    while n < min(largest, 128):
        out.append(n)
        n *= 2
    octave = 128
    while octave < largest:
        step = octave // steps_per_octave
        out.extend(s for s in range(octave, min(2 * octave, largest), step) if s >= 128 and s not in out)
        octave *= 2
    out.append(largest)
    return tuple(sorted(set(out)))


def bucket_for(batch: int, buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS) -> int:
    """The smallest bucket ``>= batch`` (:func:`bucket`); a clear error when ``batch`` exceeds the
    largest bucket."""
    check_int("batch", batch, 1)
    if batch > max(buckets):
        raise ValueError(f"batch={batch} exceeds the largest bucket {max(buckets)}; buckets: {tuple(buckets)}")
    return int(bucket(batch, buckets))


def resolve_max_num_batched_tokens(max_num_batched_tokens: int | None, rows: int) -> int:
    """The tokens a ragged round of ``rows`` execution rows feeds at most: ``max_num_batched_tokens``,
    or ``None`` for :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS` (or ``rows`` when more, so that every
    row can decode in one round).

    Raises:
      ValueError: a value that is not an integer in ``[rows, MAX_NUM_BATCHED_TOKENS_LIMIT]``.
    """
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, rows)
    return check_int("max_num_batched_tokens", max_num_batched_tokens, rows, MAX_NUM_BATCHED_TOKENS_LIMIT)
