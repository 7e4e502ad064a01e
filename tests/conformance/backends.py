"""The backends under test and their ops, jitted once per process.

Every backend registered in :mod:`ninfer_kv.ops.registry` is tested (``registered_impls()``, read
when the tests are collected); one that cannot load here is skipped with the reason
``load_impl`` gives.  The ops are called through the public front end (``ninfer_kv.ops`` with
``impl=backend``) inside ``jax.jit``, so every index is traced and nothing is checked on the host.
The jitted callables are shared by every test of a process: equal shapes compile once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.ops.registry import ImplUnavailableError, load_impl, registered_impls, registered_ops

BACKENDS = registered_impls()


def require(backend: str) -> str:
    """``backend``, or skip the test saying why it cannot load here."""
    try:
        load_impl(backend)
    except ImplUnavailableError as e:
        pytest.skip(f"backend {backend!r} is unavailable here: {e}")
    return backend


@functools.cache
def jitted(backend: str, op: str):
    """``ninfer_kv.ops.<op>`` with ``impl=backend`` under ``jax.jit`` (``sm_scale`` static).

    A backend that registers only some ops (e.g. ``"pallas_tpu"``: the paged ones) skips the tests
    of the others.
    """
    if (op, backend) not in registered_ops(backend):
        pytest.skip(f"backend {backend!r} does not provide {op}")
    fn = functools.partial(getattr(ops, op), impl=backend)
    static = ("sm_scale", "window", "soft_cap") if op.startswith("paged_attention") else ("sm_scale",)
    return jax.jit(fn, static_argnames=static if "attention" in op else ())


def _i32(x) -> jax.Array:
    return jnp.asarray(np.asarray(x, np.int64).astype(np.int32))


def paged_append(backend: str, view, table_rows, positions, k, v, valid) -> dict[str, np.ndarray]:
    """The planes (numpy) after one jitted ``paged_append``."""
    out = jitted(backend, "paged_append")(view, _i32(table_rows), _i32(positions), jnp.asarray(k), jnp.asarray(v),
                                          _i32(valid))
    return {name: np.asarray(x) for name, x in out.planes.items()}


def _attention(backend: str, op: str, q, view, rows, positions, kv_lens, sm_scale, **variant) -> np.ndarray:
    out = jitted(backend, op)(jnp.asarray(q), view, _i32(rows), _i32(positions), _i32(kv_lens), sm_scale=sm_scale,
                              **variant)
    assert out.shape == np.shape(q) and out.dtype == jnp.asarray(q).dtype, (out.shape, out.dtype)
    return np.asarray(out)


def paged_attention(backend: str, q, view, table_rows, positions, kv_lens, sm_scale=None, **variant) -> np.ndarray:
    """The output of one jitted ``paged_attention`` (numpy, in the query dtype); ``variant``:
    ``window``, ``soft_cap`` (static) and ``sinks``."""
    return _attention(backend, "paged_attention", q, view, table_rows, positions, kv_lens, sm_scale, **variant)


def cyclic_append(backend: str, view, rows, positions, k, v, valid) -> dict[str, np.ndarray]:
    """The planes (numpy) after one jitted ``cyclic_append``."""
    out = jitted(backend, "cyclic_append")(view, _i32(rows), _i32(positions), jnp.asarray(k), jnp.asarray(v),
                                           _i32(valid))
    return {name: np.asarray(x) for name, x in out.planes.items()}


def cyclic_attention(backend: str, q, view, rows, positions, kv_lens, sm_scale=None) -> np.ndarray:
    """The output of one jitted ``cyclic_attention`` (numpy, in the query dtype)."""
    return _attention(backend, "cyclic_attention", q, view, rows, positions, kv_lens, sm_scale)


QUERY_MAX = 16383
"""|q16| bound of the FFI's ``int8x2`` scores (``ffi/src/int_scores.h``)."""


def queries_as_seen(backend: str, profile, q) -> np.ndarray:
    """The queries as ``backend``'s products see them for ``profile`` (float32), so the float64
    oracle over them differs from the backend by summation order only.

    float32 products see ``q`` itself.  The FFI's ``int8x2`` scores (NVFP4 keys at the
    ``avx512vnni`` level, :func:`ninfer_kv.ops.ffi.handlers.arithmetic`) see each query row rounded once:
    ``step = max|q_row| / 16383``, ``q16 = rint(q * (16383 / max|q_row|))`` in float32, ``q16 * step``;
    the kernel keeps float32 for every row of a (batch row, KV head) task holding a non-finite
    element; this model keeps ``q`` for a whole batch row holding one (the suite's queries are
    finite).  The value sums stay float32.
    """
    q32 = np.asarray(q).astype(np.float32)
    if backend != "ffi":
        return q32
    from ninfer_kv.ops.ffi import handlers as ffi_handlers

    if ffi_handlers.arithmetic(profile, q32.shape[-1]).scores != "int8x2":
        return q32
    amax = np.abs(q32).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(amax > 0, np.float32(QUERY_MAX) / amax, np.float32(1)).astype(np.float32)
        step = np.where(amax > 0, amax / np.float32(QUERY_MAX), np.float32(1)).astype(np.float32)
        q16 = np.clip(np.rint((q32 * inv).astype(np.float32)), -QUERY_MAX, QUERY_MAX)
        rounded = (q16.astype(np.float64) * step).astype(np.float32)
    finite = np.isfinite(q32).reshape(q32.shape[0], -1).all(-1)
    return np.where(finite.reshape((-1,) + (1,) * (q32.ndim - 1)), rounded, q32)
