"""Integer array arguments as host int32/int64 arrays, with one dtype, shape and overflow check.

The shared base of the ops' integer arguments: the index vectors of the ops
(:mod:`ninfer_kv.ops.indices`: any integer array-like in, int32 out), the page copies'
``(src, dst, columns)`` (:mod:`ninfer_kv.ops.page_copy`) and the page runs
(:mod:`ninfer_kv.ops.page_runs`).  A non-integer dtype (float, bool, complex, object) is a
``TypeError``; a value that does not fit the target width is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.typing import ArrayLike

__all__ = ["INT32_MIN", "INT32_MAX", "is_tracer", "host_int_array", "int32_host_vector", "require_integer_dtype",
           "require_shape"]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def is_tracer(x) -> bool:
    """Whether ``x`` is a JAX tracer (an abstract value inside ``jax.jit``) rather than a concrete value."""
    return isinstance(x, jax.core.Tracer)


def require_integer_dtype(name: str, dtype) -> None:
    dt = np.dtype(dtype)
    if dt == np.bool_ or not np.issubdtype(dt, np.integer):
        raise TypeError(f"{name} must hold integers (any integer dtype), got dtype {dt.name}")


def require_shape(name: str, shape: tuple, want: tuple | None, ndim: int | None, what: str = "") -> None:
    if want is not None and tuple(shape) != tuple(want):
        raise ValueError(f"{name} must have shape {what}{tuple(want)}, got {tuple(shape)}")
    if want is None and ndim is not None and len(shape) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {tuple(shape)}")


def host_int_array(name: str, x: ArrayLike, *, shape: tuple | None = None, ndim: int | None = 1) -> np.ndarray:
    """A concrete integer array-like as a numpy int64 array, dtype and shape checked.

    ``shape`` (exact) or ``ndim`` (``None``: any) constrain the shape.  Values beyond int64 (only
    possible for uint64 input) are reported like int32 overflows.
    """
    if is_tracer(x):
        raise TypeError(f"{name} must be a host value (numpy, a list or a concrete jax array), not a traced value")
    if isinstance(x, (list, tuple)) and len(x) == 0:
        a = np.zeros((0,), np.int64)
    else:
        a = np.asarray(x)
    require_integer_dtype(name, a.dtype)
    require_shape(name, a.shape, shape, ndim)
    if a.dtype == np.uint64 and a.size and int(a.max()) > INT32_MAX:
        _overflow(name, a, a > np.uint64(INT32_MAX))
    return a.astype(np.int64)


def _overflow(name: str, a: np.ndarray, bad: np.ndarray):
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    where = "" if not i else f"[{', '.join(map(str, i))}]"
    raise ValueError(f"{name}{where}={int(a[i])} does not fit in int32; allowed: [{INT32_MIN}, {INT32_MAX}]")


def int32_host_vector(name: str, x: ArrayLike, *, shape: tuple | None = None, ndim: int | None = 1) -> np.ndarray:
    """A concrete integer array-like as numpy int32, with the int32 overflow check."""
    a = host_int_array(name, x, shape=shape, ndim=ndim)
    bad = (a < INT32_MIN) | (a > INT32_MAX)
    if bad.any():
        _overflow(name, a, bad)
    return a.astype(np.int32)


