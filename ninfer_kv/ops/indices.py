"""Integer index arguments of the ops: any integer array-like in, int32 out.

Row, position, length and page-ID vectors may be numpy arrays of any integer dtype, Python lists
or tuples of ints, or ``jax`` arrays.  They are converted the JAX way:

* a concrete value is read on the host, its dtype must be an integer type (``bool`` is not), every
  value must fit in int32 (else ``ValueError`` naming the argument, the index and the value), and
  the result is an int32 ``jax`` array (an int32 ``jax`` array is passed through untouched);
* a tracer (inside ``jax.jit``) must have an integer dtype and is converted with ``astype``.

A non-integer dtype (float, bool, complex, object) is a ``TypeError``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from .int_arrays import int32_host_vector, is_tracer
from .int_arrays import require_integer_dtype as _require_integer_dtype
from .int_arrays import require_shape as _require_shape

__all__ = ["int32_vector"]

def int32_vector(name: str, x: ArrayLike, length: int) -> jax.Array:
    """An op's index vector ``(B,) = (length,)`` as an int32 ``jax`` array (see the module docstring)."""
    if is_tracer(x):
        _require_integer_dtype(name, x.dtype)
        _require_shape(name, x.shape, (length,), 1, "(B,) = ")
        return x if x.dtype == jnp.int32 else x.astype(jnp.int32)
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        _require_shape(name, x.shape, (length,), 1, "(B,) = ")
        return x
    a = int32_host_vector(name, x, ndim=None)
    _require_shape(name, a.shape, (length,), 1, "(B,) = ")
    return jnp.asarray(a)
