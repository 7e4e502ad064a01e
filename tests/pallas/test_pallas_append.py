"""Pallas paged and cyclic append (interpret mode) vs the reference: bit-identical planes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cases as pc
import pallas_kernels as pk
from ninfer_kv.ops.reference import cyclic_append_reference, paged_append_reference

# Module-level jitted callables, so that equal shapes share one compilation across tests.
_append = jax.jit(pk.paged_append, static_argnames=("config", "interpret"))
_append_ref = jax.jit(paged_append_reference)
_cyclic = jax.jit(pk.cyclic_append, static_argnames=("config", "interpret"))
_cyclic_ref = jax.jit(cyclic_append_reference)


def _run_paged(profile, order, *, head_dim, kv_heads, kv_lens, valid, t_len, in_dtype, config=None, seed=0):
    case = pc.make_paged_case(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=kv_lens, seed=seed,
        extra_blocks=1 + t_len // pc.PAGE,
    )
    bsz = len(kv_lens)
    k = pc.random_tokens(seed + 1, (bsz, t_len, kv_heads, head_dim), in_dtype, scale=3.0)
    v = pc.random_tokens(seed + 2, (bsz, t_len, kv_heads, head_dim), in_dtype)
    positions = jnp.asarray(kv_lens, jnp.int32)
    valid = jnp.asarray(valid, jnp.int32)
    args = (case.view, case.table_rows, positions, k, v, valid)
    got = _append(*args, config=config)
    want = _append_ref(*args)
    pc.assert_planes_identical(got.planes, want.planes)
    return got, want


@pytest.mark.parametrize("order", pc.ORDERS)
@pytest.mark.parametrize("profile", pc.PROFILES)
def test_paged_append_matches_reference(profile, order):
    # Row 0 crosses a page boundary, row 1 writes nothing, row 2 starts mid-page, row 3 on a boundary.
    got, want = _run_paged(
        profile, order, head_dim=128, kv_heads=2, kv_lens=[62, 5, 130, 64], valid=[5, 0, 3, 5], t_len=5,
        in_dtype=jnp.float32,
    )
    # The appended tokens really landed: the planes changed where the reference wrote.
    for name in want.planes:
        untouched = pc.poisoned(want.planes[name].shape, want.planes[name].dtype)
        assert np.any(pc.as_bytes(got.planes[name]) != pc.as_bytes(untouched))


@pytest.mark.parametrize(
    "profile,order,head_dim,kv_heads",
    [
        ("int8-g64", "page-major", 64, 1),
        ("k8v4", "head-major", 64, 8),
        ("nvfp4-g16", "page-major", 256, 2),
        ("bf16", "head-major", 256, 2),
    ],
)
def test_paged_append_head_dims(profile, order, head_dim, kv_heads):
    _run_paged(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=[0, 63, 200], valid=[3, 3, 2], t_len=3,
        in_dtype=jnp.bfloat16,
    )


@pytest.mark.parametrize("profile,order", [("k8v4", "page-major"), ("int8-g64", "head-major")])
def test_paged_append_chunk_of_64(profile, order):
    # A 64-token chunk over several token tiles, one row partially valid, one crossing two pages.
    _run_paged(
        profile, order, head_dim=64, kv_heads=2, kv_lens=[10, 64, 0], valid=[64, 37, 0], t_len=64,
        in_dtype=jnp.bfloat16, config=pk.PagedAppendConfig(block_t=16),
    )


def test_paged_append_exact_codes_at_rounding_boundaries():
    """e4m3 / e2m1 rounding ties, signed zeros and underflowing scales quantize like the reference.

    K8V4 stores K as FP8 rows and V as NVFP4 groups; V gets the batch rows in reverse order, so both
    codecs see every pattern.  (INT8 ties are covered tile by tile in test_pallas_codec_tiles.)
    """
    bsz, t_len, h, d = 2, 4, 1, 64
    ties = np.zeros((bsz, t_len, h, d), np.float32)
    ties[0, 0, 0] = np.linspace(-127, 127, d) / 2
    ties[0, 1, 0] = np.tile([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], d // 8)  # e2m1 ties at scale 1
    ties[0, 2, 0] = -0.0
    ties[1, 0, 0, :16] = 1e-30  # the NVFP4 group scale underflows to 0: codes 0
    case = pc.make_paged_case("k8v4", "page-major", head_dim=d, kv_heads=h, kv_lens=[0, 0])
    args = (case.view, case.table_rows, jnp.zeros((bsz,), jnp.int32), jnp.asarray(ties), jnp.asarray(ties[::-1]),
            jnp.array([t_len, t_len], jnp.int32))
    pc.assert_planes_identical(_append(*args).planes, _append_ref(*args).planes)


@pytest.mark.parametrize("profile", ["bf16", "k8v4"])
def test_cyclic_append_matches_reference(profile):
    # Chunk longer than the ring (only its last `slots` tokens survive), a wrap-around, an empty row.
    view = pc.make_cyclic_view(profile, head_dim=64, kv_heads=2, rows=4, window=16, slots=16)
    view = pc.fill_cyclic(view, [2, 0, 3], [7, 0, 30])
    bsz, t_len = 3, 20
    k = pc.random_tokens(11, (bsz, t_len, 2, 64), jnp.float32, 2.0)
    v = pc.random_tokens(12, (bsz, t_len, 2, 64), jnp.bfloat16)
    rows, positions, valid = (jnp.array(x, jnp.int32) for x in ([2, 0, 3], [7, 0, 30], [20, 0, 5]))
    args = (view, rows, positions, k, v, valid)
    got = _cyclic(*args)
    want = _cyclic_ref(*args)
    pc.assert_planes_identical(got.planes, want.planes)


_SWEEP = [
    (profile, order, d, h, t)
    for profile, order, d, h, t in itertools.product(pc.PROFILES, pc.ORDERS, (64, 128, 256), (1, 8), (1, 3, 64))
]


@pytest.mark.slow
@pytest.mark.parametrize("profile,order,head_dim,kv_heads,t_len", _SWEEP)
def test_paged_append_sweep(profile, order, head_dim, kv_heads, t_len):
    _run_paged(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=[63, 0, 129], valid=[t_len, 0, max(1, t_len - 1)],
        t_len=t_len, in_dtype=jnp.float32, seed=head_dim + kv_heads + t_len,
    )
