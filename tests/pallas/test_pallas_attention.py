"""Pallas paged and cyclic attention (interpret mode) vs the float32 reference.

Tolerances (``pallas_cases.TOL``): float32 queries use full-precision float32 products, so the
kernel and the reference differ only in summation order (atol = rtol = 2e-5).  bfloat16 queries
use bfloat16 tensor-core products with float32 accumulation and a bfloat16 output, which costs a
couple of bfloat16 ulps (atol = rtol = 2e-2 on outputs of magnitude <= ~1).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cases as pc
import pallas_kernels as pk
from ninfer_kv.ops.reference import cyclic_attention_reference, paged_attention_reference

_attn = jax.jit(pk.paged_attention, static_argnames=("sm_scale", "config", "interpret"))
_attn_ref = jax.jit(paged_attention_reference, static_argnames=("sm_scale",))
_cyc = jax.jit(pk.cyclic_attention, static_argnames=("sm_scale", "config", "interpret"))
_cyc_ref = jax.jit(cyclic_attention_reference, static_argnames=("sm_scale",))


def _check_paged(profile, order, *, head_dim, kv_heads, group, t_len, kv_lens, positions, q_dtype, config, seed=0):
    case = pc.make_paged_case(profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=kv_lens, seed=seed)
    bsz = len(kv_lens)
    q = pc.random_tokens(seed + 7, (bsz, t_len, kv_heads * group, head_dim), q_dtype)
    args = (q, case.view, case.table_rows, jnp.asarray(positions, jnp.int32), jnp.asarray(kv_lens, jnp.int32))
    got = _attn(*args, config=config)
    want = _attn_ref(*args)
    assert got.shape == q.shape and got.dtype == q.dtype
    pc.assert_close(got, want, q_dtype)
    return np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(jnp.asarray(want, jnp.float32))


@pytest.mark.parametrize("order", pc.ORDERS)
@pytest.mark.parametrize("profile", pc.PROFILES)
def test_paged_decode_split_matches_reference(profile, order):
    # Decode with the context split over 2 programs and merged; rows: mid-page frontier, empty
    # row (kv_len 0 -> zeros), exactly one full page, three pages and a bit.
    q_dtype = jnp.bfloat16 if order == "page-major" else jnp.float32
    kv_lens = [100, 0, 64, 200]
    got, _ = _check_paged(
        profile, order, head_dim=128, kv_heads=2, group=4, t_len=1, kv_lens=kv_lens,
        positions=[99, 0, 63, 199], q_dtype=q_dtype, config=pk.PagedAttentionConfig(k_splits=2),
    )
    assert np.all(got[1] == 0), "a row with no visible key must return zeros"


@pytest.mark.parametrize(
    "profile,order,head_dim,kv_heads,group,t_len,q_dtype,config",
    [
        # chunked prefill: 3 tokens, GQA 8, one KV head
        ("int8-g64", "page-major", 64, 1, 8, 3, jnp.float32, pk.PagedAttentionConfig()),
        # speculative-verify sized chunk, no GQA, 2 pages per key step
        ("nvfp4-g16", "head-major", 64, 2, 1, 64, jnp.bfloat16, pk.PagedAttentionConfig(block_k=128)),
        # 128-token chunk, GQA 4, several query tiles and a context split
        ("k8v4", "page-major", 128, 1, 4, 128, jnp.bfloat16, pk.PagedAttentionConfig(block_q=8, k_splits=2)),
        ("bf16", "head-major", 256, 8, 1, 3, jnp.float32, pk.PagedAttentionConfig()),
        ("fp8-e4m3fn-row256", "page-major", 256, 2, 4, 1, jnp.bfloat16, pk.PagedAttentionConfig(k_splits=1)),
    ],
)
def test_paged_chunks_and_shapes(profile, order, head_dim, kv_heads, group, t_len, q_dtype, config):
    # Chunk rows end at their kv_len (keys of the chunk itself included); one row has queries
    # past its kv_len, one has no keys at all.
    kv_lens = [t_len + 70, 0, t_len + 1]
    positions = [70, 0, 3]
    _check_paged(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, group=group, t_len=t_len, kv_lens=kv_lens,
        positions=positions, q_dtype=q_dtype, config=config,
    )


def test_paged_attention_ignores_poison_beyond_kv_len():
    """NaN pages, NaN columns past the frontier and poison table entries never reach the output."""
    got, want = _check_paged(
        "bf16", "page-major", head_dim=64, kv_heads=1, group=1, t_len=2, kv_lens=[65, 1], positions=[63, 0],
        q_dtype=jnp.float32, config=pk.PagedAttentionConfig(block_k=128),
    )
    assert np.isfinite(got).all()


@pytest.mark.parametrize(
    "profile,t_len,window,slots,group,config",
    [
        ("bf16", 1, 40, 40, 2, pk.CyclicAttentionConfig(block_k=16)),
        ("k8v4", 5, 40, 48, 4, pk.CyclicAttentionConfig(block_k=32, k_splits=2)),
        ("int8-g64", 20, 16, 16, 1, pk.CyclicAttentionConfig(block_k=16)),
        ("nvfp4-g16", 3, 24, 32, 2, pk.CyclicAttentionConfig()),
    ],
)
def test_cyclic_attention_matches_reference(profile, t_len, window, slots, group, config):
    view = pc.make_cyclic_view(profile, head_dim=64, kv_heads=2, rows=4, window=window, slots=slots)
    lens = [30, 0, 25]
    view = pc.fill_cyclic(view, [3, 0, 1], lens)
    # Queries end at the rows' last written position (row 1 is empty); row 2 has a query past it.
    positions = [30 - t_len, 0, 25 - t_len + 2]
    q = pc.random_tokens(5, (3, t_len, 2 * group, 64), jnp.float32)
    args = (q, view, jnp.array([3, 0, 1], jnp.int32), jnp.array(positions, jnp.int32), jnp.array(lens, jnp.int32))
    got = _cyc(*args, config=config)
    pc.assert_close(got, _cyc_ref(*args), jnp.float32)
    assert np.all(np.asarray(got)[1] == 0)


_SWEEP = [
    c
    for c in itertools.product(pc.PROFILES, pc.ORDERS, (64, 128, 256), (1, 2, 8), (1, 4, 8), (1, 3, 64, 128))
    if c[3] * c[4] <= 32
]


@pytest.mark.slow
@pytest.mark.parametrize("profile,order,head_dim,kv_heads,group,t_len", _SWEEP)
def test_paged_attention_sweep(profile, order, head_dim, kv_heads, group, t_len):
    kv_lens = [t_len + 130, 0, t_len + 5]
    _check_paged(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, group=group, t_len=t_len, kv_lens=kv_lens,
        positions=[130, 0, 5], q_dtype=jnp.bfloat16 if t_len % 2 else jnp.float32, config=pk.PagedAttentionConfig(),
        seed=head_dim + t_len,
    )
