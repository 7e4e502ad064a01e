"""Bucket ladders: the fixed buffer lengths that bound how many programs a step compiles.

Every variable-length part of a round work (table updates, COW copies, Host restores, offload page
lists) is padded to the smallest bucket of a fixed ladder that holds it, so a jitted step sees one
shape per bucket, never one per length.
"""

from __future__ import annotations

from ..step_shapes import ladder_rungs

__all__ = ["ladder", "bucket"]


def ladder(first: int, factor: int, cap: int) -> tuple[int, ...]:
    """Bucket sizes ``0, first, first * factor, ...`` up to and including ``cap``."""
    return tuple(sorted({0, *ladder_rungs(first, factor, max(cap, 0))}))


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n`` entries."""
    for b in sizes:
        if n <= b:
            return b
    raise ValueError(f"{n} entries exceed the largest bucket {sizes[-1]}")
