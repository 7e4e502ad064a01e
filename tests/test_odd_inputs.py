"""Odd inputs give one answer in every implementation (reference, FFI, Pallas interpret).

* Out-of-range indices under ``jax.jit`` (where nothing can be checked): table rows outside
  ``[0, C)``, block-table entries outside ``[0, N)`` (negative, ``N``, ``INT32_MAX``), positions
  past ``L * 64`` or negative, ``valid`` past ``T`` or negative, ``kv_lens`` past ``L * 64``.  One
  poisoned input goes through every implementation: the planes must come back byte-identical to
  the numpy expectation (written tokens exactly where the rules put them, every other byte
  untouched), attention must match the numpy model of the rules and inert rows must be zeros.
* Odd values in K/V (NaN, +-inf, subnormals, zeros, -0.0, rounding ties): every implementation
  stores exactly the codes and scales of the numpy oracle, NaN bits included.
* The same indices given concretely are rejected before anything runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import PagedKVStorageLayout, ops
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

from tests.ops import np_codecs
from tests.ops.cases import plane_index, poison_planes

P = 64
IMPLS = ("reference", "ffi", "pallas")
I32_MAX = 2**31 - 1


def _impl(name: str) -> str:
    try:
        ops.resolve_impl(name)
    except ops.ImplUnavailableError as e:
        pytest.skip(f"{name} is not available here: {e}")
    return name


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_bits(got, want, what: str) -> None:
    g, w = _bits(got), _bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    bad = g != w
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {i}: {g[i]:#x} != {w[i]:#x}")


# -- one poisoned index input ----------------------------------------------------------------------

PROFILE = "k8v4"  # FP8 rows for K, NVFP4 groups for V: bf16 and uint8 scale planes, e4m3 and byte codes
H, D, N, C, L, T, NUM_LAYERS, LAYER = 1, 64, 6, 4, 2, 3, 2, 1


def _poisoned_index_case():
    """Table rows 0..3 and five batch rows, each hitting one out-of-range rule."""
    rng = np.random.default_rng(0)
    lay = PagedKVStorageLayout(PROFILE, NUM_LAYERS, H, D, order="head-major")
    planes = poison_planes(lay.plane_shapes(N), lay.plane_dtypes(), rng, mode="nan")
    # Mapped pages 0..4 of the layer hold real tokens; page N - 1 = 5 and the other layer stay
    # poisoned (a negative entry wrapped to N - 1 would read or overwrite them).
    filler = rng.standard_normal((N - 1, P, H, D)).astype(np.float32)
    codes = np_codecs.encode_kv(PROFILE, filler, filler)
    for page in range(N - 1):
        idx = plane_index(lay.order, LAYER, np.full(P, page), np.arange(P))
        for name in planes:
            planes[name][idx] = codes[name][page]
    tables = np.array([
        [0, 1],          # row 0: fully mapped
        [2, -1],         # row 1: block 1 unmapped (negative: must not wrap to page N - 1)
        [N, 3],          # row 2: block 0 out of range (N)
        [4, I32_MAX],    # row 3: block 1 out of range (INT32_MAX)
    ], np.int32)
    table_rows = np.array([7, 1, 2, 0, -1], np.int32)  # 7 and -1: outside [0, C) -> inert
    positions = np.array([0, 62, 63, 127, -2], np.int32)
    valid = np.array([3, 3, 3, 9, 3], np.int32)  # 9 > T: clipped to T
    kv_lens = np.array([5, 200, 66, 40, 9], np.int32)  # 200 > L * P: clipped
    k = rng.standard_normal((5, T, H, D)).astype(np.float32)
    v = (rng.standard_normal((5, T, H, D)) * 3).astype(np.float32)
    q = rng.standard_normal((5, T, 2 * H, D)).astype(np.float32)
    return lay, planes, tables, table_rows, positions, valid, kv_lens, k, v, q


def _expected_writes(tables, table_rows, positions, valid):
    """(batch row, token, page, column) of every token the rules write."""
    out = []
    for b in range(len(table_rows)):
        r = int(table_rows[b])
        if not 0 <= r < C:
            continue
        for t in range(min(max(int(valid[b]), 0), T)):
            pos = int(positions[b]) + t
            if not 0 <= pos < L * P:
                continue
            page = int(tables[r, pos // P])
            if 0 <= page < N:
                out.append((b, t, page, pos % P))
    return out


def _expected_attention(planes, lay, tables, table_rows, positions, kv_lens, q):
    """float64 numpy model of the rules over the pages the append left behind."""
    bsz = len(table_rows)
    k_all = np.zeros((bsz, L * P, H, D), np.float32)
    v_all = np.zeros((bsz, L * P, H, D), np.float32)
    vis = np.zeros((bsz, T, L * P), bool)
    for b in range(bsz):
        r = int(table_rows[b])
        if not 0 <= r < C:
            continue
        for j in range(min(int(kv_lens[b]), L * P)):
            page = int(tables[r, j // P])
            if not 0 <= page < N:
                continue
            idx = plane_index(lay.order, LAYER, np.array([page]), np.array([j % P]))
            codes = {name: planes[name][idx][0] for name in planes}  # (H, X)
            kk, vv = np_codecs.decode_kv(PROFILE, codes)
            k_all[b, j], v_all[b, j] = kk, vv
            for t in range(T):
                vis[b, t, j] = j <= int(positions[b]) + t
    return np_codecs.attention(q, k_all, v_all, vis, 1.0 / np.sqrt(D))


@pytest.fixture(scope="module")
def index_case():
    return _poisoned_index_case()


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_indices_under_jit_follow_one_rule(impl, index_case):
    impl = _impl(impl)
    lay, planes, tables, table_rows, positions, valid, kv_lens, k, v, q = index_case

    @jax.jit
    def step(planes, tables, rows, pos, k, v, valid, q, lens):
        view = PagedKVBatchLayerView(planes, tables, LAYER, lay)
        view = ops.paged_append(view, rows, pos, k, v, valid, impl=impl)
        return view.planes, ops.paged_attention(q, view, rows, pos, lens, impl=impl)

    args = [jnp.asarray(a) for a in (tables, table_rows, positions, k, v, valid, q, kv_lens)]
    got_planes, got_out = step({n: jnp.asarray(a) for n, a in planes.items()}, *args)

    want = {n: a.copy() for n, a in planes.items()}
    enc = np_codecs.encode_kv(PROFILE, k, v)
    writes = _expected_writes(tables, table_rows, positions, valid)
    assert len(writes) == 5  # batch row 1: 62, 63; row 2: 64, 65; row 3: 127; nothing else
    for b, t, page, col in writes:
        idx = plane_index(lay.order, LAYER, np.array([page]), np.array([col]))
        for name in want:
            want[name][idx] = enc[name][b, t][None]
    for name in want:
        _assert_bits(got_planes[name], want[name], f"{impl}: plane {name}")

    out = np.asarray(got_out).astype(np.float32)
    assert np.isfinite(out).all(), f"{impl}: poison leaked into the attention output"
    assert not out[0].any() and not out[4, :2].any(), f"{impl}: inert rows / queries before key 0 must be zeros"
    exp = _expected_attention(want, lay, tables, table_rows, positions, kv_lens, q)
    np.testing.assert_allclose(out, exp, rtol=2e-5, atol=2e-5, err_msg=impl)


CYC = CyclicKVLayout("int8-g64", num_layers=2, rows=3, num_kv_heads=1, head_dim=64, window=4, slots=6)


def _cyclic_step(impl, rows, positions, valid, kv_lens, seed=1, attend=True):
    """Append (then attend) through ``impl`` under jit; returns (poisoned pre-state, planes, out, k)."""
    rng = np.random.default_rng(seed)
    planes = poison_planes(CYC.plane_shapes(), CYC.plane_dtypes(), rng, mode="nan")
    k = rng.standard_normal((len(rows), 3, 1, 64)).astype(np.float32)
    q = rng.standard_normal((len(rows), 3, 1, 64)).astype(np.float32)

    @jax.jit
    def step(planes, rows, pos, k, valid, q, lens):
        view = CyclicKVCacheLayerView(planes, 1, CYC)
        view = ops.cyclic_append(view, rows, pos, k, k, valid, impl=impl)
        return view.planes, (ops.cyclic_attention(q, view, rows, pos, lens, impl=impl) if attend else q)

    args = [jnp.asarray(np.asarray(a, np.int32)) for a in (rows, positions)]
    args += [jnp.asarray(k), jnp.asarray(np.asarray(valid, np.int32)), jnp.asarray(q), jnp.asarray(np.asarray(kv_lens, np.int32))]
    got_planes, out = step({n: jnp.asarray(a) for n, a in planes.items()}, *args)
    return planes, got_planes, np.asarray(out), k


def _expect_cyclic(planes, rows, positions, k, tokens):
    want = {n: a.copy() for n, a in planes.items()}
    enc = np_codecs.encode_kv(CYC.profile.value, k, k)
    for b, t in tokens:
        pos = int(positions[b]) + t
        for name in want:
            want[name][1, rows[b], :, pos % CYC.slots] = enc[name][b, t]
    return want


@pytest.mark.parametrize("impl", IMPLS)
def test_cyclic_rows_outside_the_state_are_inert_under_jit(impl):
    impl = _impl(impl)
    rows = [3, 1, -1, 0]  # 3 and -1 are outside [0, rows=3)
    positions = [0, 0, 0, -2]  # -2: tokens at -2, -1 are dropped
    planes, got_planes, out, k = _cyclic_step(impl, rows, positions, valid=[2, 3, 2, 3], kv_lens=[2, 3, 2, 1])
    want = _expect_cyclic(planes, rows, positions, k, [(1, 0), (1, 1), (1, 2), (3, 2)])
    for name in want:
        _assert_bits(got_planes[name], want[name], f"{impl}: cyclic plane {name}")
    assert np.isfinite(out[[0, 2]]).all() and not out[[0, 2]].any(), f"{impl}: inert rows must return zeros"
    assert not out[3, :2].any(), f"{impl}: queries at negative positions see no key"
    assert np.isfinite(out[[1, 3]]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_cyclic_valid_beyond_t_is_clipped_under_jit(impl):
    """valid = 9 > T = 3 writes the row's 3 tokens (the 'last slots survive' rule uses clip(valid, 0, T))."""
    impl = _impl(impl)
    rows, positions = [1], [0]
    planes, got_planes, _, k = _cyclic_step(impl, rows, positions, valid=[9], kv_lens=[3], attend=False)
    want = _expect_cyclic(planes, rows, positions, k, [(0, 0), (0, 1), (0, 2)])
    for name in want:
        _assert_bits(got_planes[name], want[name], f"{impl}: cyclic plane {name}")


def test_the_same_indices_given_concretely_are_rejected(index_case):
    lay, planes, tables, table_rows, positions, valid, kv_lens, k, v, q = index_case
    view = PagedKVBatchLayerView({n: jnp.asarray(a) for n, a in planes.items()}, jnp.asarray(tables), LAYER, lay)
    ok_rows = np.array([0, 1, 2, 3, 0], np.int32)
    with pytest.raises(ValueError, match=r"table_rows\[0\]=7 is out of range; allowed: \[0, C=4\)"):
        ops.paged_append(view, table_rows, positions, k, v, np.minimum(valid, T), impl="reference")
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1 \(table row 1 = table_rows\[1\], logical block 1\)"):
        ops.paged_append(view, ok_rows, np.array([0, 62, 0, 0, 0]), k, v, np.full(5, T), impl="reference")
    with pytest.raises(ValueError, match=r"block_tables\[2, 0\] = 6 .* whose entries must lie in \[0, N=6\)"):
        ops.paged_attention(q, view, ok_rows, np.zeros(5, np.int32), [1, 1, 1, 1, 1], impl="reference")
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=200 is out of range; allowed: \[0, L\*P=128\]"):
        ops.paged_attention(q, view, ok_rows, np.zeros(5, np.int32), kv_lens, impl="reference")


# -- odd values in K/V -----------------------------------------------------------------------------


def _odd_rows(d: int = 64) -> np.ndarray:
    """(R, d) float32 rows: each one exercises NaN, inf, subnormal, zero or tie handling."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((14, d)).astype(np.float32)
    r = base.copy()
    r[0, 3] = np.nan                                   # NaN in the first group
    r[1, 17] = -np.nan                                 # negative NaN in an NVFP4 group 1 / second half
    r[2, 5] = np.inf                                   # +inf
    r[3, 40] = -np.inf                                 # -inf
    r[4, 7], r[4, 9] = -np.inf, np.nan                 # inf and NaN in one group
    r[5] = 0.0                                         # all zeros
    r[6] = -0.0                                        # all negative zeros
    r[7] = base[7] * np.float32(1e-39)                 # every element subnormal
    r[8] = base[8] * np.float32(2e-38)                 # normal amax, subnormal amax / 127 and / 448
    r[9, ::2] = np.float32(3e-40)                      # subnormals beside normal values
    r[9, 1::4] = -np.float32(2e-41)
    r[10] = np.resize(np.arange(-31.5, 32.0, 1.0, dtype=np.float32), d)  # rint ties at s = 2**-2
    r[10, 0] = 31.75
    ties = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0], np.float32)
    r[11] = np.tile(ties, d // 16)                     # e2m1 ties, scale exactly 1
    r[12] = np.float32(3.4e38) * np.sign(base[12])     # near float32 max (bf16 scale rounding)
    r[13, :16] = np.float32(1.1754944e-38)             # FLT_MIN group
    return r


ODD_PROFILES = ("bf16", "int8-g64", "k8v4")  # every codec: K8V4 stores K as FP8 rows and V as NVFP4


@pytest.fixture(scope="module", params=IMPLS)
def odd_planes(request):
    """One implementation's stored planes for the odd rows (K = x, V = -x), one append per profile."""
    impl = _impl(request.param)
    x = _odd_rows()
    rows = x.shape[0]
    k = jnp.asarray(x[:, None, None, :])
    out = {}
    for profile in ODD_PROFILES:
        lay = PagedKVStorageLayout(profile, 1, 1, x.shape[1], order="page-major")
        view = PagedKVBatchLayerView(lay.allocate(rows), jnp.arange(rows, dtype=jnp.int32)[:, None], 0, lay)
        f = jax.jit(lambda view, r, p, k, v, n: ops.paged_append(view, r, p, k, v, n, impl=impl))
        got = f(view, jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32), k, -k, jnp.ones(rows, jnp.int32))
        out[profile] = {n: np.asarray(a)[0, :, 0, 0, :] for n, a in got.planes.items()}
    return impl, x, out


@pytest.mark.parametrize("profile", ODD_PROFILES)
def test_odd_values_store_the_oracle_bits(profile, odd_planes):
    impl, x, out = odd_planes
    want = np_codecs.encode_kv(profile, x, -x)
    for name, w in want.items():
        _assert_bits(out[profile][name], w, f"{impl} {profile} plane {name}")


def test_the_oracle_states_the_odd_value_rules():
    """The numpy oracle itself encodes SEMANTICS: NaN scales, codes 0, inf scale, flushed subnormals."""
    x = _odd_rows()
    code, scale = np_codecs.encode("int8-g64", x)
    s = _bits(scale)
    assert s[0, 0] == 0x7FC0 and s[1, 0] == 0x7FC0 and s[4, 0] == 0x7FC0  # NaN -> canonical NaN scale
    assert s[2, 0] == 0x7F80 and s[3, 0] == 0x7F80  # +-inf -> +inf scale
    assert not code[[0, 1, 2, 3, 4], :64].any()  # non-finite scale -> codes 0
    assert s[7, 0] == 0 and s[8, 0] == 0 and not code[[7, 8]].any()  # subnormal quotient flushed
    assert not code[9, ::2].any()  # subnormal inputs read as zero
    code, scale = np_codecs.encode("fp8-e4m3fn-row", x)
    assert _bits(scale)[0, 0] == 0x7FC0 and not _bits(code)[[0, 1, 2, 3, 4]].any()
    assert (_bits(code)[6] == 0).all()  # zero scale: +0 codes even for -0.0 inputs
    code, scale = np_codecs.encode("nvfp4-g16", x)
    assert scale[0, 0] == 0x7F and scale[1, 1] == 0x7F and scale[2, 0] == 0x7E  # NaN 0x7F; inf -> 448
    assert not code[0, :8].any() and not code[1, 8:16].any()
    assert code[2, 2] >> 4 == 0x7  # +inf (element 5: high nibble of byte 2) clips to +6 under the scale 448
    code, _ = np_codecs.encode("bf16", x)
    assert _bits(code)[0, 3] == 0x7FC0 and _bits(code)[1, 17] == 0x7FC0
    assert (_bits(code)[7] & 0x7F80 == 0).all() and _bits(code)[7].any()  # bf16 keeps subnormals


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("order", ("page-major", "head-major"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("profile", ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"))
def test_odd_values_sweep(profile, head_dim, order, impl):
    """Wide sweep: every profile, head dim and plane order, odd rows tiled to the head dim."""
    impl = _impl(impl)
    x = np.concatenate([_odd_rows(64)] * (head_dim // 64), axis=1)
    x = np.concatenate([x, np.roll(x, 17, axis=1)])  # the odd lanes in other groups too
    rows = x.shape[0]
    lay = PagedKVStorageLayout(profile, 1, 1, head_dim, order=order)
    view = PagedKVBatchLayerView(lay.allocate(rows), jnp.arange(rows, dtype=jnp.int32)[::-1, None], 0, lay)
    k = jnp.asarray(x[:, None, None, :])
    f = jax.jit(lambda view, r, p, k, v, n: ops.paged_append(view, r, p, k, v, n, impl=impl))
    got = f(view, jnp.arange(rows, dtype=jnp.int32), jnp.full(rows, 5, jnp.int32), k, -k, jnp.ones(rows, jnp.int32))
    want = np_codecs.encode_kv(profile, x, -x)
    pages = np.arange(rows)[::-1]
    for name, w in want.items():
        idx = plane_index(lay.order, 0, pages, np.full(rows, 5))
        _assert_bits(np.asarray(got.planes[name])[idx][:, 0], w, f"{impl} {profile} D={head_dim} {order} {name}")
