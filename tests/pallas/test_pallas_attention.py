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


def _odd_inputs(case, kv_lens, positions):
    """Add the out-of-range cases of SEMANTICS A to a paged case (see :func:`_check_paged`)."""
    view, rows = case.view, np.asarray(case.table_rows)
    table = np.array(view.block_tables)
    c_rows, width = table.shape
    long_row = int(np.argmax(kv_lens))
    if kv_lens[long_row] > pc.PAGE:
        table[rows[long_row], 1] = -7  # a hole: block 1 of the longest row is invisible
    full_page = table[rows[long_row], 0]  # 64 finite tokens
    spare = sorted(set(range(c_rows)) - set(rows.tolist()))[0]
    table[spare, :] = full_page  # every entry a real page: a kv_len past L * 64 is clipped
    rows = np.concatenate([rows, [c_rows + 3, -1, spare, rows[long_row]]])
    kv_lens = list(kv_lens) + [50, 50, 10**6, int(kv_lens[long_row])]
    positions = list(positions) + [0, 0, 10**6, -5]
    return view.replace(block_tables=jnp.asarray(table)), rows, kv_lens, positions


def _check_paged(profile, order, *, head_dim, kv_heads, group, t_len, kv_lens, positions, q_dtype, config, seed=0,
                 odd_inputs=False):
    """Kernel vs the float32 reference (or, with ``odd_inputs``, vs the dense oracle of the rules).

    ``odd_inputs`` adds: a hole (an out-of-range table entry) in the longest row, a table row past
    ``C`` and a negative one (zeros), a row with ``kv_len`` past ``L * 64`` over real pages
    (clipped), and a row whose queries start at position -5 (they see no key until 0).
    """
    case = pc.make_paged_case(profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=kv_lens, seed=seed)
    view, rows = case.view, np.asarray(case.table_rows)
    if odd_inputs:
        view, rows, kv_lens, positions = _odd_inputs(case, kv_lens, positions)
    bsz = len(rows)
    q = pc.random_tokens(seed + 7, (bsz, t_len, kv_heads * group, head_dim), q_dtype)
    args = (q, view, jnp.asarray(rows, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(kv_lens, jnp.int32))
    got = _attn(*args, config=config)
    want = pc.expected_paged_attention(*args) if odd_inputs else _attn_ref(*args)
    assert got.shape == q.shape and got.dtype == q.dtype
    pc.assert_close(got, want, q_dtype)
    return np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(jnp.asarray(want, jnp.float32))




@pytest.mark.parametrize("profile,order,head_dim", pc.DEFAULT_CASES)
def test_paged_decode_split_matches_reference(profile, order, head_dim):
    # Decode with the context split over 2 programs and merged; rows: mid-page frontier, empty
    # row (kv_len 0 -> zeros), exactly one full page, three pages and a bit; plus the odd rows.
    q_dtype = jnp.bfloat16 if order == "page-major" else jnp.float32
    kv_lens = [100, 0, 64, 200]
    # Head-major cases take two pages per key step (block-table loads of a page vector).
    config = pk.PagedAttentionConfig(k_splits=2, block_k=64 if order == "page-major" else 128)
    got, _ = _check_paged(
        profile, order, head_dim=head_dim, kv_heads=2, group=4, t_len=1, kv_lens=kv_lens,
        positions=[99, 0, 63, 199], q_dtype=q_dtype, config=config, odd_inputs=True,
    )
    assert np.all(got[1] == 0), "a row with no visible key must return zeros"
    assert np.all(got[4:6] == 0), "a table row outside [0, C) must return zeros"
    assert np.all(got[7] == 0), "a query at a negative position must return zeros"


@pytest.mark.slow
@pytest.mark.parametrize("order", pc.ORDERS)
@pytest.mark.parametrize("profile", pc.PROFILES)
def test_paged_decode_every_profile_and_order(profile, order):
    _check_paged(
        profile, order, head_dim=128, kv_heads=2, group=4, t_len=1, kv_lens=[100, 0, 64, 200],
        positions=[99, 0, 63, 199], q_dtype=jnp.float32, config=pk.PagedAttentionConfig(k_splits=2), odd_inputs=True,
    )


_CHUNKS = [
    # chunked prefill: 3 tokens, GQA 8, one KV head
    ("int8-g64", "page-major", 64, 1, 8, 3, jnp.float32, pk.PagedAttentionConfig()),
    # speculative-verify sized chunk, no GQA, 2 pages per key step
    ("nvfp4-g16", "head-major", 64, 2, 1, 64, jnp.bfloat16, pk.PagedAttentionConfig(block_k=128)),
    # 128-token chunk, GQA 4, several query tiles and a context split
    ("k8v4", "page-major", 64, 1, 4, 128, jnp.bfloat16, pk.PagedAttentionConfig(block_q=8, k_splits=2)),
    ("bf16", "head-major", 256, 8, 1, 3, jnp.float32, pk.PagedAttentionConfig()),
    ("fp8-e4m3fn-row256", "page-major", 256, 2, 4, 1, jnp.bfloat16, pk.PagedAttentionConfig(k_splits=1)),
]
_DEFAULT_CHUNKS = (2,)


@pytest.mark.parametrize(
    "profile,order,head_dim,kv_heads,group,t_len,q_dtype,config",
    [c if i in _DEFAULT_CHUNKS else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(_CHUNKS)],
)
def test_paged_chunks_and_shapes(profile, order, head_dim, kv_heads, group, t_len, q_dtype, config):
    # Chunk rows end at their kv_len (keys of the chunk itself included); one row has queries
    # past its kv_len, one has no keys at all; plus the odd rows.
    kv_lens = [t_len + 70, 0, t_len + 1]
    positions = [70, 0, 3]
    _check_paged(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, group=group, t_len=t_len, kv_lens=kv_lens,
        positions=positions, q_dtype=q_dtype, config=config, odd_inputs=True,
    )


@pytest.mark.slow
def test_paged_attention_ignores_poison_beyond_kv_len():
    """NaN pages, NaN columns past the frontier and poison table entries never reach the output."""
    got, want = _check_paged(
        "bf16", "page-major", head_dim=64, kv_heads=1, group=1, t_len=2, kv_lens=[65, 1], positions=[63, 0],
        q_dtype=jnp.float32, config=pk.PagedAttentionConfig(block_k=128),
    )
    assert np.isfinite(got).all()


_CYCLIC = [
    ("bf16", 5, 40, 48, 4, pk.CyclicAttentionConfig(block_k=32, k_splits=2)),
    ("bf16", 1, 40, 40, 2, pk.CyclicAttentionConfig(block_k=16)),
    ("k8v4", 5, 40, 48, 4, pk.CyclicAttentionConfig(block_k=32, k_splits=2)),
    ("int8-g64", 20, 16, 16, 1, pk.CyclicAttentionConfig(block_k=16)),
    ("nvfp4-g16", 3, 24, 32, 2, pk.CyclicAttentionConfig()),
]


@pytest.mark.parametrize(
    "profile,t_len,window,slots,group,config",
    [c if i == 0 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(_CYCLIC)],
)
def test_cyclic_attention_matches_reference(profile, t_len, window, slots, group, config):
    view = pc.make_cyclic_view(profile, head_dim=64, kv_heads=2, rows=4, window=window, slots=slots)
    lens = [30, 0, 25]
    view = pc.fill_cyclic(view, [3, 0, 1], lens)
    # Queries end at the rows' last written position (row 1 is empty); row 2 has a query past it.
    # Rows 3 and 4 name rings outside [0, 4) (zeros); row 5's queries start at a negative position.
    rows = [3, 0, 1, 4, -2, 3]
    positions = [30 - t_len, 0, 25 - t_len + 2, 10, 10, -3]
    lens += [30, 30, 30]
    q = pc.random_tokens(5, (len(rows), t_len, 2 * group, 64), jnp.float32)
    got = _cyc(q, view, jnp.array(rows, jnp.int32), jnp.array(positions, jnp.int32), jnp.array(lens, jnp.int32),
               config=config)
    ref_rows = [r if 0 <= r < 4 else 0 for r in rows]
    ref_lens = [n if 0 <= r < 4 else 0 for r, n in zip(rows, lens)]
    want = _cyc_ref(q, view, jnp.array(ref_rows, jnp.int32), jnp.array(positions, jnp.int32),
                    jnp.array(ref_lens, jnp.int32))
    pc.assert_close(got, want, jnp.float32)
    assert np.all(np.asarray(got)[1] == 0)
    assert np.all(np.asarray(got)[3:5] == 0)


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
