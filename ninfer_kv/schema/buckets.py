"""Step-work shapes: how a serving loop bounds the programs that apply round works.

Every jitted program that applies a :class:`~ninfer_kv.schema.round_work.RoundWork` compiles once per shape of the
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

__all__ = ["StepWorkShapes", "step_work_shapes", "step_work_shape", "ladder_rungs", "ladder", "bucket"]

Shape = tuple[int, int, int]


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

    The one bucket ladder of the package (``first >= 1``, ``factor >= 2``): the alone shapes here,
    the store's buffer buckets (:func:`ninfer_kv.schema.buckets.ladder`) and the decoder's batch
    buckets (:func:`ninfer_kv.models.decoder.buckets.bucket_ladder`).
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
