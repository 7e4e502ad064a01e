"""Snapshots of window rings: whole-ring copies and the snapshot slots that hold them.

A model with sliding-window layers keeps them in per-row window rings (:mod:`ninfer_kv.planning.rings`),
which the next sequence on the row overwrites.  So that prefix reuse and forks stay exact, a row's
ring is copied whole into a **snapshot slot** when its sequence is retained, the checkpoint carries a
:class:`RingImage` (its store ``state_image``) naming the slot, and a sequence that resumes from the
checkpoint gets the slot copied into its own row's ring before its first step.  Rows are rings
``0 .. C - 1`` and slot ``s`` is ring ``C + s``; a copy keeps the ``b mod k`` placement, so it is
``k`` pages of every ring layer and plane, nothing rotated (:func:`copy_ring`: one jitted, donated
call, compiled once, ordered after every step that wrote the source and before every step that reads
the destination by the state's own data dependency).

The reuse rule.  A sequence resumes from a checkpoint at ``m`` tokens only where every layer type
holds what it needs: the Main pool's full-attention layers at any ``m`` up to the checkpoint's
frontier ``c`` (shared pages and a copied tail), the ring layers where the snapshot holds every key
their windows see before ``m`` (``max(0, m - W + 1) >=`` the snapshot's first position, true at
``m = c``, :meth:`~ninfer_kv.planning.rings.WindowRings.resumable`: a conversation's next turn, which
resumes at ``c``, always can; so can a fork up to about ``step_tokens`` tokens before ``c``).  A
match that fails the rule is not reused at all: no shorter one would pass it either.

:class:`RingSnapshots` hands out the slots (``WindowRings.snapshots``); whoever retains decides what
to give up when none is free (the engine releases its least recently used cached entry holding one,
docs/ENGINE.md).  Releasing a checkpoint frees its slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ..planning.rings import RingPlan
from ..schema.integers import check_int
from .state import KVDeviceState, check_live

__all__ = ["copy_ring", "RingImage", "RingSnapshots"]


def copy_ring(state: KVDeviceState, src: int, dst: int) -> KVDeviceState:
    """``state`` with ring ``dst`` (a row ``< C`` or a snapshot slot ``C + s``) holding ring ``src``'s
    pages; ``state`` is donated.  ``ValueError`` for a state without rings or a ring index outside
    ``[0, C + snapshots)``; ``src == dst`` copies nothing."""
    ring = state.ring
    if ring is None:
        raise ValueError("this state has no window rings: nothing to copy")
    src = check_int("src ring", src, 0, ring.slots - 1)
    dst = check_int("dst ring", dst, 0, ring.slots - 1)
    check_live(state)
    if src == dst:
        return state
    return _copy(state, jnp.int32(src), jnp.int32(dst))


@functools.partial(jax.jit, donate_argnums=0)
def _copy(state: KVDeviceState, src: jax.Array, dst: jax.Array) -> KVDeviceState:
    k = state.ring.pages_per_row
    rings = {}
    for name, plane in state.rings.items():  # page-major: (layers, pages, H, P, X)
        block = jax.lax.dynamic_slice_in_dim(plane, src * k, k, axis=1)
        rings[name] = jax.lax.dynamic_update_slice_in_dim(plane, block, dst * k, axis=1)
    return state.replace(rings=rings)


@dataclasses.dataclass(frozen=True)
class RingImage:
    """The state image of a ring model's checkpoint: its snapshot ``slot`` and the ``frontier`` the
    snapshot was taken at."""

    slot: int
    frontier: int


class RingSnapshots:
    """The snapshot slots of one store's window rings (module docstring).

    Args:
      plan: the store's :class:`~ninfer_kv.planning.rings.RingPlan` (``plan.spec.snapshots`` slots).
      copy: ``copy(src_ring, dst_ring)`` copies one ring onto another in the caller's device state
        (:func:`copy_ring` on the state it threads).
    """

    def __init__(self, plan: RingPlan, copy: Callable[[int, int], None]):
        self.plan = plan
        self.copy = copy
        self._free = list(range(plan.spec.snapshots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.taken = 0
        self.restored = 0

    @property
    def free_slots(self) -> int:
        """Slots no checkpoint holds."""
        return len(self._free)

    def capture(self, row: int, frontier: int) -> RingImage | None:
        """Copy ``row``'s ring into a free slot; the :class:`RingImage`, or ``None`` when no slot is free."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.copy(row, self.plan.rows + slot)
        self.taken += 1
        return RingImage(slot, int(frontier))

    def restore(self, image: RingImage, row: int) -> None:
        """Copy ``image``'s slot into ``row``'s ring (the row's sequence resumes from it)."""
        self.copy(self.plan.rows + image.slot, row)
        self.restored += 1

    def free(self, image) -> None:
        """Give ``image``'s slot back (its checkpoint was released); ``None`` is ignored."""
        if isinstance(image, RingImage):
            if image.slot in self._free:
                raise RuntimeError(f"ring snapshot slot {image.slot} freed twice")
            self._free.append(image.slot)

    def resumable(self, image, m: int) -> bool:
        """Whether a sequence may resume at ``m`` tokens from a checkpoint with ``image`` (the rule of
        the module docstring; ``False`` for a checkpoint without a snapshot)."""
        return isinstance(image, RingImage) and self.plan.spec.resumable(image.frontier, m)
