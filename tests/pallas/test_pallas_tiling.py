"""Pallas kernel configs other than the defaults (token tiles, key blocks, query tiles, context
splits) give the numpy model's answers, in interpret mode.

The conformance suite (tests/conformance) runs the default configs; here the same poisoned pools
(:mod:`tests.conformance.cases`) go through explicit configs, with the same oracle and tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conformance import np_ops
from tests.conformance.cases import (
    ORDERS,
    PAGE,
    PROFILES,
    CyclicGeometry,
    append_case,
    append_geometry,
    make_cyclic_case,
    make_paged_case,
    random_kv,
    richest_profile,
)
from tests.conformance.checks import assert_attention_close, assert_same_planes

_append = jax.jit(pk.paged_append, static_argnames=("config", "interpret"))
_attention = jax.jit(pk.paged_attention, static_argnames=("sm_scale", "config", "interpret"))
_cyclic_attention = jax.jit(pk.cyclic_attention, static_argnames=("sm_scale", "config", "interpret"))


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _default_first(values, default):
    return [pytest.param(v, id=str(getattr(v, "value", v)), marks=() if v is default else (pytest.mark.slow,))
            for v in values]


@pytest.mark.parametrize("profile", _default_first(PROFILES, richest_profile()))
def test_append_in_token_tiles_of_4(profile):
    """block_t = 4 on chunks of 5: a full and a one-token tile per row, rows crossing a page boundary."""
    g = append_geometry(profile)
    case = append_case(g, seed=1)
    positions, valid = [60, 0, 125, 3 * PAGE - 5], [5, 3, 0, 5]
    k, v = random_kv(np.random.default_rng(2), (g.batch, g.t, g.heads, g.head_dim), dtype=g.kv_dtype, spread=True)
    out = _append(case.view(), _i32(case.table_rows), _i32(positions), jnp.asarray(k), jnp.asarray(v), _i32(valid),
                  config=pk.PagedAppendConfig(block_t=4))
    want = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, case.table_rows, positions, k, v,
                               valid)
    assert_same_planes({n: np.asarray(x) for n, x in out.planes.items()}, want, f"{profile.value} block_t=4")


@pytest.mark.slow
def test_append_chunk_of_64_in_tiles_of_16():
    """A 64-token chunk over four token tiles, one row partially valid, one crossing two pages."""
    g = append_geometry(PROFILES[1])
    case = make_paged_case(g.profile, g.order, kv_lens=[0, 0, 0], mapped_tokens=[192] * 3, head_dim=g.head_dim,
                           poison="bytes")
    positions, valid = [10, 64, 100], [64, 37, 0]
    k, v = random_kv(np.random.default_rng(3), (3, 64, 2, g.head_dim), spread=True)
    out = _append(case.view(), _i32(case.table_rows), _i32(positions), jnp.asarray(k), jnp.asarray(v), _i32(valid),
                  config=pk.PagedAppendConfig(block_t=16))
    want = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, case.table_rows, positions, k, v,
                               valid)
    assert_same_planes({n: np.asarray(x) for n, x in out.planes.items()}, want, "block_t=16")


def _check_attention(profile, order, *, head_dim, heads, group, t, q_dtype, config, kv_lens, positions, logical_pages=3):
    case = make_paged_case(profile, order, kv_lens=kv_lens, heads=heads, head_dim=head_dim,
                           logical_pages=logical_pages, seed=t + group)
    q = np.random.default_rng(4).standard_normal((len(kv_lens), t, heads * group, head_dim)).astype(np.float32)
    q = q.astype(jnp.dtype(q_dtype))
    got = _attention(jnp.asarray(q), case.view(), _i32(case.table_rows), _i32(positions), _i32(kv_lens), config=config)
    want = np_ops.paged_attention(q, case.planes, case.layout, case.layer, case.block_tables, case.table_rows,
                                  positions, kv_lens)
    out = assert_attention_close(got, want, backend="pallas", q_dtype=q_dtype, what=str(config))
    assert not out[np.asarray(kv_lens) == 0].any(), "a row with no key must return zeros"


# Decode with the context split over 2 programs; head-major takes two pages per key step.
_DECODE = [
    (PROFILES[0], ORDERS[0], pk.PagedAttentionConfig(k_splits=2, block_k=64)),
    (PROFILES[1], ORDERS[1], pk.PagedAttentionConfig(k_splits=2, block_k=128)),
] + [(p, o, pk.PagedAttentionConfig(k_splits=2, block_k=64 * (1 + ORDERS.index(o)))) for p in PROFILES[2:] for o in ORDERS]


@pytest.mark.parametrize(
    "profile,order,config",
    [pytest.param(*c, id=f"{c[0].value}-{c[1].value}", marks=() if i < 2 else (pytest.mark.slow,))
     for i, c in enumerate(_DECODE)],
)
def test_decode_split_over_programs(profile, order, config):
    """Rows at a mid-page frontier, without keys, with one full page and with three pages and a bit."""
    _check_attention(profile, order, head_dim=64, heads=2, group=4, t=1, q_dtype="float32", config=config,
                     kv_lens=[100, 0, 64, 180], positions=[99, 0, 63, 179])


_CHUNKS = [
    # 128-token chunk, GQA 4, query tiles of 8, a context split
    (richest_profile(), ORDERS[0], 64, 1, 4, 128, "bfloat16", pk.PagedAttentionConfig(block_q=8, k_splits=2)),
    # speculative-verify sized chunk, no GQA, 2 pages per key step
    (PROFILES[3], ORDERS[1], 64, 2, 1, 64, "bfloat16", pk.PagedAttentionConfig(block_k=128)),
    (PROFILES[0], ORDERS[1], 256, 8, 1, 3, "float32", pk.PagedAttentionConfig()),
    (PROFILES[2], ORDERS[0], 256, 2, 4, 1, "bfloat16", pk.PagedAttentionConfig(k_splits=1)),
]


@pytest.mark.parametrize(
    "profile,order,head_dim,heads,group,t,q_dtype,config",
    [pytest.param(*c, id=f"{c[0].value}-t{c[5]}", marks=() if i == 0 else (pytest.mark.slow,))
     for i, c in enumerate(_CHUNKS)],
)
def test_chunks_in_query_tiles(profile, order, head_dim, heads, group, t, q_dtype, config):
    """Chunk rows end at their kv_len (the chunk's own keys included); one row has no key."""
    _check_attention(profile, order, head_dim=head_dim, heads=heads, group=group, t=t, q_dtype=q_dtype, config=config,
                     kv_lens=[t + 70, 0, t + 1], positions=[70, 0, 1], logical_pages=-(-(t + 70) // PAGE))


_CYCLIC = [
    (PROFILES[0], 5, 40, 48, 4, pk.CyclicAttentionConfig(block_k=32, k_splits=2)),
    (PROFILES[0], 1, 40, 40, 2, pk.CyclicAttentionConfig(block_k=16)),
    (richest_profile(), 5, 40, 48, 4, pk.CyclicAttentionConfig(block_k=32, k_splits=2)),
    (PROFILES[1], 1, 16, 16, 1, pk.CyclicAttentionConfig(block_k=16)),
    (PROFILES[3], 3, 24, 32, 2, pk.CyclicAttentionConfig()),
]


@pytest.mark.parametrize(
    "profile,t,window,slots,group,config",
    [pytest.param(*c, id=f"{c[0].value}-t{c[1]}-w{c[2]}-s{c[3]}", marks=() if i == 0 else (pytest.mark.slow,))
     for i, c in enumerate(_CYCLIC)],
)
def test_cyclic_key_blocks_and_splits(profile, t, window, slots, group, config):
    """Wrapped rings read in key blocks (and context splits) of the config, beside an empty ring."""
    g = CyclicGeometry(profile, 64, window, slots)
    written = np.array([30, 0, 25, 60])
    case = make_cyclic_case(g, written=written, seed=t)
    rows = np.array([3, 1, 2])  # ring 1 is empty
    kv_lens = written[rows]
    positions = np.maximum(kv_lens - t, 0)
    q = np.random.default_rng(5).standard_normal((3, t, 2 * group, 64)).astype(np.float32)
    got = _cyclic_attention(jnp.asarray(q), case.view(), _i32(rows), _i32(positions), _i32(kv_lens), config=config)
    want = np_ops.cyclic_attention(q, case.planes, case.layout, case.layer, rows, positions, kv_lens)
    out = assert_attention_close(got, want, backend="pallas", q_dtype="float32", what=str(config))
    assert not out[1].any()

