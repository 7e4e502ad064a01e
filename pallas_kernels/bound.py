"""The four public ops bound to one kernel backend: the registry entries of a Pallas backend.

``bound_ops("mosaic_gpu")`` returns ``(paged_append, paged_attention, cyclic_append,
cyclic_attention)`` whose configs name that backend (a config passed in keeps its block sizes and
gets the backend replaced), so a backend module can expose them as module attributes and register
them in :mod:`ninfer_kv.ops.registry` as ``"pallas_kernels.<name>_backend:<op>"``.  The default
backend (``"triton"``) needs none of this: the ``"pallas"`` entries are the package's own ops.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from . import cyclic, paged_append, paged_attention
from .config import CyclicAppendConfig, CyclicAttentionConfig, PagedAppendConfig, PagedAttentionConfig

__all__ = ["bound_ops"]

_OPS = (
    (paged_append.paged_append, PagedAppendConfig),
    (paged_attention.paged_attention, PagedAttentionConfig),
    (cyclic.cyclic_append, CyclicAppendConfig),
    (cyclic.cyclic_attention, CyclicAttentionConfig),
)


def _bind(fn: Callable, config_type: type, backend: str) -> Callable:
    @functools.wraps(fn)
    def bound(*args, config=None, **kwargs):
        config = config_type(backend=backend) if config is None else dataclasses.replace(config, backend=backend)
        return fn(*args, config=config, **kwargs)

    bound.__qualname__ = bound.__name__ = f"{fn.__name__}_{backend}"
    return bound


def bound_ops(backend: str) -> tuple[Callable, Callable, Callable, Callable]:
    """``(paged_append, paged_attention, cyclic_append, cyclic_attention)`` running on kernel backend ``backend``.

    The backend is looked up when an op runs (:func:`pallas_kernels.backend.kernel_backend`), so a
    backend module may call this while it is being imported.
    """
    return tuple(_bind(fn, config_type, backend) for fn, config_type in _OPS)
