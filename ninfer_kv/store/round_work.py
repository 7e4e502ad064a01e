"""Round work, under its original module: the data (:mod:`ninfer_kv.work`), the store's pending
page writes (:mod:`ninfer_kv.store.page_writes`), the bucket ladders and step shapes, and — loaded
on first use — the device functions that apply it (:mod:`ninfer_kv.device.work`)."""

from __future__ import annotations

from ..layout import word_dtype
from ..step_shapes import StepWorkShapes, step_work_shape, step_work_shapes
from ..work import GatherRequest, OffloadPayload, PendingWork, PoolWork, RoundWork
from .buckets import bucket, ladder
from .page_writes import PageWrites

__all__ = [
    "RoundWork",
    "PoolWork",
    "PendingWork",
    "PageWrites",
    "GatherRequest",
    "OffloadPayload",
    "apply_work",  # noqa: F822 (loaded on first use)
    "apply_work_jit",  # noqa: F822 (loaded on first use)
    "gather_pages",  # noqa: F822 (loaded on first use)
    "gather_pages_jit",  # noqa: F822 (loaded on first use)
    "resync",  # noqa: F822 (loaded on first use)
    "step_work_shape",
    "step_work_shapes",
    "StepWorkShapes",
    "take_step_work",  # noqa: F822 (loaded on first use)
    "bucket",
    "ladder",
    "word_dtype",
]

_DEVICE_NAMES = ("apply_work", "apply_work_jit", "gather_pages", "gather_pages_jit", "resync", "take_step_work",
                 "_apply_work_jit", "_shapes")


def __getattr__(name: str):
    """The device functions, loaded on first use (the store never imports JAX)."""
    if name in _DEVICE_NAMES:
        from ..device import work

        return getattr(work, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
