"""Lockstep rounds: every data shard's scheduler round, with their units merged into shared mesh steps.

Each data shard runs its own scheduler over its own store.  A round of shard ``d`` is ordinary,
sequential code (admit, prefill chunks, decode, finish) whose units call the mesh step; what makes
the shards share steps is where those calls go.  :class:`LockstepRounds` runs every shard's round
as a *task* on its own thread, one task at a time (the others wait: no two tasks ever run at once,
so the stores, the prefix caches and the shared device state see one sequential program).  A task
that reaches a unit hands the unit's inputs to the coordinator and parks.  When every task is
parked or done, the coordinator merges the parked units of one kind into a single mesh step — shard
``d``'s lanes in batch slots ``[d * b, (d + 1) * b)`` — runs it, gives each task its slice of the
outputs and resumes them, in shard order.  So one mesh step serves up to ``D * B_local`` real
lanes, and a round costs as many mesh steps as the busiest shard has units, not the sum over shards.

The order of everything a task does is its own program order, and tasks run in shard order between
steps, so a run is deterministic; the tokens of a request depend only on its own lanes' inputs.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

__all__ = ["Unit", "LockstepRounds"]


@dataclasses.dataclass
class Unit:
    """One shard's unit, parked until its merged step ran.

    ``kind`` groups units that can share a step (the step's name: they take the same inputs
    shapes); ``inputs`` is whatever the step runner needs of this shard; ``output`` is set by the
    runner.
    """

    shard: int
    kind: str
    inputs: Any
    output: Any = None


class _Task:
    """One shard's round on its own thread; it runs only while it holds the baton."""

    def __init__(self, shard: int, body: Callable[[], None]):
        self.shard = shard
        self.body = body
        self.go = threading.Event()
        self.parked = threading.Event()  # set when the task parks on a unit or ends
        self.unit: Unit | None = None
        self.done = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"shard-{shard}-round", daemon=True)

    def _run(self) -> None:
        self.go.wait()
        try:
            self.body()
        except BaseException as e:  # handed to the coordinator, which raises it
            self.error = e
        self.done = True
        self.unit = None
        self.parked.set()

    def resume(self) -> None:
        """Give the baton to this task and wait until it parks again or ends."""
        self.parked.clear()
        self.go.set()
        self.parked.wait()


class LockstepRounds:
    """Coordinator of lockstep rounds over ``D`` data shards.

    Args:
      run_units: ``run_units(kind, units)`` runs one merged step for ``units`` (at most one per
        shard, all of ``kind``) and sets each unit's ``output``.

    Attributes:
      steps: merged steps run so far.
      units: shard units those steps served.
    """

    def __init__(self, run_units: Callable[[str, list], None]):
        self._run_units = run_units
        self._current: _Task | None = None
        self._aborted = False
        self.steps = 0
        self.units = 0

    def submit(self, shard: int, kind: str, inputs: Any) -> Any:
        """From inside a task: park this shard on a unit of ``kind``; returns its output once the
        merged step ran.  Outside :meth:`round` (no task), the unit runs alone at once."""
        task = self._current
        unit = Unit(shard, kind, inputs)
        if task is None or threading.current_thread() is not task.thread:
            self._execute(kind, [unit])
            return unit.output
        task.unit = unit
        task.go.clear()
        task.parked.set()
        task.go.wait()  # the coordinator ran the step and resumed this task
        if self._aborted:
            raise RuntimeError(f"shard {shard}: the round was abandoned (another shard's round failed)")
        return unit.output

    def round(self, bodies: Sequence[tuple[int, Callable[[], None]]]) -> None:
        """Run one round of every ``(shard, body)`` in lockstep (see the module docstring)."""
        tasks = [_Task(shard, body) for shard, body in bodies]
        self._aborted = False
        for t in tasks:
            t.thread.start()
        try:
            for t in tasks:  # every task runs until its first unit (or its end), in shard order
                self._give(t)
            while True:
                parked = [t for t in tasks if not t.done and t.unit is not None]
                if not parked:
                    break
                kind = parked[0].unit.kind  # the lowest parked shard's kind: deterministic
                group = [t for t in parked if t.unit.kind == kind]
                self._execute(kind, [t.unit for t in group])
                for t in group:
                    t.unit = None
                    self._give(t)
        except BaseException:
            self._aborted = True  # parked tasks raise when resumed, and end
            raise
        finally:
            for t in tasks:
                if not t.done:
                    t.parked.clear()
                    t.go.set()
                    t.parked.wait()
                t.thread.join()
        for t in tasks:
            if t.error is not None:
                raise t.error

    def _give(self, task: _Task) -> None:
        self._current = task
        try:
            task.resume()
        finally:
            self._current = None

    def _execute(self, kind: str, units: list) -> None:
        self._run_units(kind, units)
        self.steps += 1
        self.units += len(units)
