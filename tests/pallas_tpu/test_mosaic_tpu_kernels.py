"""Kernel-level tests of the Mosaic TPU backend (``pallas_kernels.mosaic_tpu``) in TPU interpret mode.

Pools hold their pages in a random physical order; every page no row maps, the other layer and the
table entries past each row's blocks (the sentinel ``-1``) are poison (NaN in float planes).
Appends must store the reference's bits and change nothing else; attention (GQA, decode and
chunks) must be finite and close to the float32 reference.  One case runs with the interpreter's
race detector on and asserts that it found no race.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.reference import paged_append_reference, paged_attention_reference
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.ops.views import PagedKVBatchLayerView, allocate_planes
from pallas_kernels.mosaic_tpu import paged_append, paged_attention

HEADS, GROUP, D, PAGES, BLOCKS = 2, 2, 64, 7, 3
ORDERS = ("page-major", "head-major")


def _pool(profile: KVProfile, order: str, seed: int):
    """A poisoned 2-layer pool (layer 1 used) whose rows 2 and 0 map 2 and 3 pages in random order."""
    rng = np.random.default_rng(seed)
    lay = PagedKVStorageLayout(profile, 2, HEADS, D, order)
    planes = allocate_planes(lay, PAGES, fill=float("nan"))
    planes = {n: (p if jnp.issubdtype(p.dtype, jnp.floating) else
                  jnp.asarray(rng.integers(0, 256, p.shape).astype(np.dtype(p.dtype))))
              for n, p in planes.items()}
    perm = rng.permutation(PAGES)
    tables = np.full((3, BLOCKS), -1, np.int32)
    tables[0] = perm[:3]
    tables[2, :2] = perm[3:5]
    view = PagedKVBatchLayerView(planes, jnp.asarray(tables), jnp.int32(1), lay)
    rows, kv_lens = jnp.asarray([2, 0], jnp.int32), np.array([70, 150])
    t = int(kv_lens.max())
    k, v = (rng.standard_normal((2, 2, t, HEADS, D)).astype(np.float32) * np.array([1, 3], np.float32)[:, None, None, None, None])
    view = jax.jit(paged_append_reference)(view, rows, jnp.zeros(2, jnp.int32), jnp.asarray(k), jnp.asarray(v),
                                  jnp.asarray(kv_lens, jnp.int32))
    return view, rows, kv_lens, rng


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}")


def _check_append(view, rows, positions, k, v, valid, interpret=None):
    args = (view, rows, jnp.asarray(positions, jnp.int32), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid, jnp.int32))
    got = jax.jit(functools.partial(paged_append, interpret=interpret))(*args).planes
    want = jax.jit(paged_append_reference)(*args).planes
    for name in want:
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)


def _check_attention(view, rows, positions, kv_lens, q, interpret=None):
    args = (jnp.asarray(q), view, rows, jnp.asarray(positions, jnp.int32), jnp.asarray(kv_lens, jnp.int32))
    got = np.asarray(jax.jit(functools.partial(paged_attention, interpret=interpret))(*args)).astype(np.float32)
    want = np.asarray(jax.jit(paged_attention_reference)(*args)).astype(np.float32)
    assert np.isfinite(got).all()
    tol = 2e-2 if q.dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# The default run takes K8V4 (both kinds of scale plane, two codecs); -m slow takes every profile.
_PROFILES = [pytest.param(p, id=p.value, marks=() if p is KVProfile.K8V4 else (pytest.mark.slow,)) for p in KVProfile]


@pytest.mark.parametrize("profile", _PROFILES)
def test_chunk_append_and_gqa_chunk_attention(profile):
    """Every profile: 3-token chunks (one crossing a page boundary) are stored bit for bit; GQA attention of 3-token chunks over both rows matches."""
    i = list(KVProfile).index(profile)
    view, rows, kv_lens, rng = _pool(profile, ORDERS[i % 2], seed=i)
    k, v = rng.standard_normal((2, 2, 3, HEADS, D)).astype(np.float32)
    _check_append(view, rows, [62, 149], k, v, [3, 2])
    q = rng.standard_normal((2, 3, HEADS * GROUP, D)).astype(np.float32)
    if i % 2:
        q = q.astype(jnp.bfloat16)
    _check_attention(view, rows, kv_lens - 3, kv_lens, q)


def test_decode_with_race_detection():
    """Decode (T = 1) append and attention under the race detector: same results, no race found."""
    view, rows, kv_lens, rng = _pool(KVProfile.K8V4, "page-major", seed=9)
    params = pltpu.InterpretParams(detect_races=True)
    k, v = rng.standard_normal((2, 2, 1, HEADS, D)).astype(np.float32)
    _check_append(view, rows, kv_lens, k, v, [1, 1], interpret=params)
    assert not tpu_interpret.races.races_found, "the race detector found a race in paged_append"
    q = rng.standard_normal((2, 1, HEADS * GROUP, D)).astype(np.float32)
    _check_attention(view, rows, kv_lens - 1, kv_lens, q, interpret=params)
    assert not tpu_interpret.races.races_found, "the race detector found a race in paged_attention"


def test_unsupported_config_is_rejected():
    """Another backend's compiler knobs are a TypeError naming the expected type."""
    from pallas_kernels.common.config import PagedAttentionConfig

    view, rows, kv_lens, _ = _pool(KVProfile.BF16, "page-major", seed=1)
    with pytest.raises(TypeError, match="MosaicConfig"):
        paged_attention(jnp.zeros((2, 1, 4, D)), view, rows, jnp.asarray(kv_lens - 1), jnp.asarray(kv_lens),
                        config=PagedAttentionConfig(compiler=object()))


def test_mosaic_config_bounds_the_vmem_limit():
    """``vmem_limit_bytes`` is None or an int in [4 KiB, 1 GiB]; anything else names the range."""
    from pallas_kernels.mosaic_tpu.backend import MosaicConfig

    assert MosaicConfig().vmem_limit_bytes is None and MosaicConfig(4096).vmem_limit_bytes == 4096
    for bad in (4095, 1 << 31, 2.5, "1MiB"):
        with pytest.raises((ValueError, TypeError), match="vmem_limit_bytes"):
            MosaicConfig(bad)
