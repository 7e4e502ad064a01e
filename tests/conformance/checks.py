"""Comparisons of the kernel tests: stored planes bit for bit, attention within a stated tolerance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def raw_bits(x) -> np.ndarray:
    """The array as unsigned integers of its item size, so NaN payloads compare like any value."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_same_bits(got, want, what: str) -> None:
    """``got`` and ``want`` hold the same bits, element by element."""
    g, w = raw_bits(got), raw_bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    bad = g != w
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {i}: got {g[i]:#x}, want {w[i]:#x}"
        )


def assert_same_planes(got: dict, want: dict, what: str) -> None:
    """Every plane of ``got`` holds exactly the bits of ``want`` (written codes and untouched poison)."""
    assert set(got) == set(want), f"{what}: planes {sorted(got)} != {sorted(want)}"
    for name in want:
        assert_same_bits(got[name], want[name], f"{what}: plane {name}")


# Attention tolerance (atol = rtol) against the float64 oracle, per query dtype.  float32 queries:
# float32 products, only the summation order differs.  bfloat16 queries: a backend may take
# bfloat16 products (Pallas: the probability tile is rounded to bfloat16 before the P.V product)
# and returns bfloat16, a couple of bfloat16 ulps on outputs of magnitude <= ~10.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
# Backends that compute in float32 whatever the query dtype and round the result to bfloat16 once:
# for them bfloat16 queries are held to one rounding (2**-8 relative) plus the float32 tolerance.
FLOAT32_PRODUCTS = ("reference", "ffi")


def attention_tolerance(backend: str, q_dtype) -> dict:
    """``assert_allclose`` keywords for ``backend`` with queries of ``q_dtype``."""
    name = jnp.dtype(q_dtype).name
    if name == "bfloat16" and backend in FLOAT32_PRODUCTS:
        return dict(rtol=2.0**-8, atol=TOLERANCE["float32"])
    return dict(rtol=TOLERANCE[name], atol=TOLERANCE[name])


def assert_attention_close(got, want, *, backend: str, q_dtype, what: str = "") -> np.ndarray:
    """``got`` is finite (no poison read) and within the tolerance of ``want``; returns it as float32."""
    g = np.asarray(got).astype(np.float32)
    assert g.shape == np.shape(want), f"{what}: shape {g.shape} != {np.shape(want)}"
    assert np.isfinite(g).all(), f"{backend} {what}: non-finite output (poison was read)"
    np.testing.assert_allclose(g, want, err_msg=f"{backend} {what}", **attention_tolerance(backend, q_dtype))
    return g
