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


def _run_paged(profile, order, *, head_dim, kv_heads, kv_lens, valid, t_len, in_dtype, config=None, seed=0,
               odd_inputs=False):
    """Append ``t_len`` tokens per row and compare every plane byte for byte with the reference.

    With ``odd_inputs``: row 0 has its second block's table entry replaced by an out-of-range ID
    (its tokens there are dropped), and three batch rows are added: a table row past ``C``, a
    negative table row (both inert), and a row starting at position -3 (its first 3 tokens
    dropped); and K/V get non-finite values: a NaN in one token, +inf and -inf in another, and
    a whole token of NaN (the reference quantizes them by the agreed rules).
    """
    case = pc.make_paged_case(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=kv_lens, seed=seed,
        extra_blocks=1 + t_len // pc.PAGE,
    )
    view, rows = case.view, np.asarray(case.table_rows)
    positions, valid = list(kv_lens), list(valid)
    if odd_inputs:
        table = np.array(view.block_tables)
        table[rows[0], 1] = 2**30
        view = view.replace(block_tables=jnp.asarray(table))
        rows = np.concatenate([rows, [table.shape[0] + 3, -1, rows[1]]])
        positions += [0, 0, -3]
        valid += [t_len, t_len, t_len]
    bsz = len(rows)
    k = pc.random_tokens(seed + 1, (bsz, t_len, kv_heads, head_dim), in_dtype, scale=3.0)
    v = pc.random_tokens(seed + 2, (bsz, t_len, kv_heads, head_dim), in_dtype)
    if odd_inputs:
        k = k.at[0, 0, 0, 5].set(jnp.nan).at[2, 1, :, 70 % head_dim].set(jnp.inf)
        v = v.at[2, 0, 1, 3].set(-jnp.inf).at[3, 2].set(jnp.nan)
    positions = jnp.asarray(positions, jnp.int32)
    got = _append(view, jnp.asarray(rows, jnp.int32), positions, k, v, jnp.asarray(valid, jnp.int32), config=config)
    ref_view, ref_rows, ref_valid = pc.sanitized_for_reference(view, rows, valid)
    want = _append_ref(ref_view, ref_rows, positions, k, v, ref_valid)
    pc.assert_planes_identical(got.planes, want.planes)
    return got, want




@pytest.mark.parametrize("profile,order,head_dim", pc.DEFAULT_CASES)
def test_paged_append_matches_reference(profile, order, head_dim):
    # Row 0 crosses a page boundary (into a block whose entry is out of range), row 1 writes
    # nothing, row 2 starts mid-page, row 3 on a boundary; plus the inert and negative rows.
    # Two token tiles per row (block_t = 4), non-finite K/V values.
    got, want = _run_paged(
        profile, order, head_dim=head_dim, kv_heads=2, kv_lens=[62, 5, 130, 64], valid=[5, 0, 3, 5], t_len=5,
        in_dtype=jnp.bfloat16 if order == "head-major" else jnp.float32, odd_inputs=True,
        config=pk.PagedAppendConfig(block_t=4),
    )
    # The appended tokens really landed: the planes changed where the reference wrote.
    for name in want.planes:
        untouched = pc.poisoned(want.planes[name].shape, want.planes[name].dtype)
        assert np.any(pc.as_bytes(got.planes[name]) != pc.as_bytes(untouched))


@pytest.mark.slow
@pytest.mark.parametrize("order", pc.ORDERS)
@pytest.mark.parametrize("profile", pc.PROFILES)
def test_paged_append_every_profile_and_order(profile, order):
    _run_paged(
        profile, order, head_dim=128, kv_heads=2, kv_lens=[62, 5, 130, 64], valid=[5, 0, 3, 5], t_len=5,
        in_dtype=jnp.float32, odd_inputs=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "profile,order,head_dim,kv_heads",
    [
        ("int8-g64", "page-major", 64, 1),
        ("k8v4", "head-major", 64, 8),
        ("nvfp4-g16", "page-major", 256, 2),
        ("bf16", "head-major", 256, 2),
        ("fp8-e4m3fn-row256", "head-major", 8, 2),
        ("nvfp4-g16", "page-major", 16, 2),
    ],
)
def test_paged_append_head_dims(profile, order, head_dim, kv_heads):
    _run_paged(
        profile, order, head_dim=head_dim, kv_heads=kv_heads, kv_lens=[0, 63, 200], valid=[3, 3, 2], t_len=3,
        in_dtype=jnp.bfloat16,
    )


@pytest.mark.slow
def test_paged_append_chunk_of_64():
    # A 64-token chunk over several token tiles, one row partially valid, one crossing two pages.
    _run_paged(
        "int8-g64", "page-major", head_dim=64, kv_heads=2, kv_lens=[10, 64, 0], valid=[64, 37, 0], t_len=64,
        in_dtype=jnp.bfloat16, config=pk.PagedAppendConfig(block_t=16),
    )


_NAN_SCALE = {"bf16": 0x7FC0, "uint8": 0x7F}
_INF_SCALE_BF16 = 0x7F80


def _non_finite_groups(profile, x):
    """Per plane with a scale: ``(mask of NaN groups, mask of infinite-scale groups)`` of ``x (..., D)``."""
    out = {}
    d = x["k"].shape[-1]
    for tensor in ("k", "v"):
        codec = profile.codec(tensor)
        group = {"int8-g64": 64, "nvfp4-g16": 16, "fp8-e4m3fn-row256": d}.get(codec.value)
        if group is None:
            continue
        g = x[tensor].reshape(x[tensor].shape[:-1] + (d // group, group))
        nan = np.isnan(g).any(-1)
        inf = np.isinf(g).any(-1) & ~nan & (codec.value != "nvfp4-g16")  # NVFP4: scale 448, normal codes
        out[tensor] = (nan, inf)
    return out


@pytest.mark.slow  # default run: non-finite K/V in test_paged_append_matches_reference, rules in the tile tests
@pytest.mark.parametrize("profile", ["k8v4", "int8-g64"])
def test_paged_append_exact_codes_at_boundaries_and_non_finite(profile):
    """Rounding ties, signed zeros, underflowing scales, NaN and infinity quantize by the agreed rules.

    K8V4 stores K as FP8 rows and V as NVFP4 groups; V gets the batch rows in reverse order, so both
    codecs see every pattern.  A group holding a NaN stores a NaN scale (bf16 0x7FC0, NVFP4 byte
    0x7F) and codes 0; an INT8 / FP8 group with an infinite amax stores scale +inf and codes 0.
    Expected: the reference append of the input with those groups zeroed, their scales patched.
    """
    from ninfer_kv.profiles import KVProfile

    prof = KVProfile.parse(profile)
    bsz, t_len, h, d = 2, 6, 1, 128
    x = np.zeros((bsz, t_len, h, d), np.float32)
    x[0, 0, 0] = np.linspace(-127, 127, d) / 2
    x[0, 1, 0] = np.tile([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], d // 8)  # e2m1 ties at scale 1
    x[0, 2, 0] = -0.0
    x[1, 0, 0, :16] = 1e-30  # the NVFP4 group scale underflows to 0: codes 0
    x[1, 1, 0] = np.random.RandomState(1).standard_normal(d)
    x[0, 3, 0] = x[1, 1, 0]
    x[0, 3, 0, 5] = np.nan  # NaN in the first group
    x[1, 2, 0] = x[1, 1, 0]
    x[1, 2, 0, 70] = np.inf  # +inf in the second INT8 group / fifth NVFP4 group
    x[0, 4, 0] = x[1, 1, 0]
    x[0, 4, 0, 127] = -np.inf
    x[0, 4, 0, 17] = np.nan
    x[1, 3:, 0] = np.nan  # whole tokens of NaN
    k, v = x, x[::-1].copy()
    case = pc.make_paged_case(profile, "page-major", head_dim=d, kv_heads=h, kv_lens=[0, 0])
    pos = jnp.zeros((bsz,), jnp.int32)
    valid = jnp.array([t_len, t_len], jnp.int32)
    got = _append(case.view, case.table_rows, pos, jnp.asarray(k), jnp.asarray(v), valid)

    bad = _non_finite_groups(prof, {"k": k, "v": v})
    clean = {}
    for tensor, arr in (("k", k), ("v", v)):
        arr = arr.copy()
        if tensor in bad:
            nan, inf = bad[tensor]
            group = d // nan.shape[-1]
            arr[np.repeat(nan | inf, group, axis=-1)] = 0.0
        clean[tensor] = arr
    want = _append_ref(case.view, case.table_rows, pos, jnp.asarray(clean["k"]), jnp.asarray(clean["v"]), valid)
    want_planes = {n: np.array(pc.as_bytes(p)) for n, p in want.planes.items()}
    table = np.asarray(case.view.block_tables)
    rows = np.asarray(case.table_rows)
    for tensor, (nan, inf) in bad.items():
        plane = want_planes[f"{tensor}_scale"]
        width = plane.shape[-1] if plane.ndim == 6 else 1  # bf16 scales come as (..., X, 2) bytes
        for b, t, hh, g in zip(*np.nonzero(nan | inf)):
            page = table[rows[b], t // pc.PAGE]
            bits = (_NAN_SCALE["bf16" if width == 2 else "uint8"] if nan[b, t, hh, g] else _INF_SCALE_BF16)
            if width == 2:
                plane[pc.LAYER, page, hh, t % pc.PAGE, g] = [bits & 0xFF, bits >> 8]
            else:
                plane[pc.LAYER, page, hh, t % pc.PAGE, g] = bits
    for name, w in want_planes.items():
        g = pc.as_bytes(got.planes[name])
        diff = np.argwhere(g != w)
        assert diff.size == 0, f"plane {name}: {len(diff)} bytes differ, first at {diff[:3].tolist()}"


@pytest.mark.parametrize("profile", ["bf16", pytest.param("k8v4", marks=pytest.mark.slow)])
def test_cyclic_append_matches_reference(profile):
    # Chunk longer than the ring (only its last `slots` tokens survive), a wrap-around, an empty row.
    view = pc.make_cyclic_view(profile, head_dim=64, kv_heads=2, rows=4, window=16, slots=16)
    view = pc.fill_cyclic(view, [2, 0, 3], [7, 0, 30])
    t_len = 20
    # Rows 3 and 4 name rings outside [0, rows): inert; row 5 starts at a negative position.
    bsz = 6
    k = pc.random_tokens(11, (bsz, t_len, 2, 64), jnp.float32, 2.0)
    v = pc.random_tokens(12, (bsz, t_len, 2, 64), jnp.bfloat16)
    rows, positions, valid = ([2, 0, 3, 4, -1, 1], [7, 0, 30, 0, 0, -4], [20, 0, 5, 9, 9, 7])
    got = _cyclic(view, *(jnp.array(x, jnp.int32) for x in (rows, positions)), k, v, jnp.array(valid, jnp.int32))
    ref_rows = [r if 0 <= r < 4 else 0 for r in rows]
    ref_valid = [n if 0 <= r < 4 else 0 for r, n in zip(rows, valid)]
    want = _cyclic_ref(view, *(jnp.array(x, jnp.int32) for x in (ref_rows, positions)), k, v,
                       jnp.array(ref_valid, jnp.int32))
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
