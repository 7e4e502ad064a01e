"""The reference ops (through ninfer_kv.ops, impl="reference") against independent numpy models.

Attention is compared with a float64 loop over rows, queries and heads on the oracle-decoded K/V;
appends must write exactly the oracle codes at the expected (page, column) and leave every other
byte of every plane (all layers, NaN payloads included) untouched.
"""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_kv import KVProfile, PlaneOrder, ops
from ninfer_kv.views import PagedKVBatchLayerView, PagedKVLayerView

from . import np_codecs
from .cases import P, expected_paged_append, make_cyclic_case, make_paged_case, paged_visible

PROFILES = list(KVProfile)
ORDERS = list(PlaneOrder)
GROUP_T = list(itertools.product((1, 4, 8), (1, 3, 64)))  # all 9 (GQA group, T) pairs
# Run by default: bf16/head T=3, int8/head D=128 GQA 4, nvfp4/page GQA 8, k8v4/page T=64 bf16 q
# (every codec, both orders, T = 1, 3, 64, groups 1, 4, 8); the other six are marked slow.
DEFAULT_ATTENTION_CASES = (1, 3, 6, 8)


def _attention_cases():
    """Every profile x order; the 9 (group, T) pairs rotate so each order meets every pair."""
    out = []
    for i, profile in enumerate(PROFILES):
        for j, order in enumerate(ORDERS):
            k = 2 * i + j
            group, t = GROUP_T[k % 9]
            head_dim = 128 if k % 4 == 3 else 64
            q_dtype = "bfloat16" if k % 3 == 2 else "float32"
            marks = () if k in DEFAULT_ATTENTION_CASES else (pytest.mark.slow,)
            out.append(pytest.param(profile, order, group, t, head_dim, q_dtype, marks=marks,
                                    id=f"{profile.value}-{order.value}-g{group}-t{t}-d{head_dim}-{q_dtype}"))
    return out


def _row_setup(t: int, seed: int):
    """kv_lens / positions of 4 rows: chunk at a mid-page frontier, empty row, short kv, full capacity."""
    rng = np.random.default_rng(seed)
    cap = 3 * P
    mid = int(rng.integers(t + 1, cap - P)) | 1  # odd: mid-page
    kv_lens = np.array([mid, 0, int(rng.integers(1, 40)), cap], np.int32)
    positions = np.array([mid - t, int(rng.integers(0, 5)), int(rng.integers(45, 100)), cap - t], np.int32)
    return kv_lens, positions


_attend = jax.jit(
    lambda q, view, rows, pos, lens: ops.paged_attention(q, view, rows, pos, lens, impl="reference")
)


@pytest.mark.parametrize("profile,order,group,t,head_dim,q_dtype", _attention_cases())
def test_paged_attention_matches_numpy(profile, order, group, t, head_dim, q_dtype):
    kv_lens, positions = _row_setup(t, seed=t * 7 + group)
    case = make_paged_case(profile, order, kv_lens=kv_lens, head_dim=head_dim, seed=group * 100 + t)
    h = case.layout.num_kv_heads
    q = np.random.default_rng(1).standard_normal((4, t, h * group, head_dim)).astype(np.float32)
    q = q.astype(np.dtype(q_dtype))
    out = _attend(jnp.asarray(q), case.view(), jnp.asarray(case.table_rows), jnp.asarray(positions), jnp.asarray(kv_lens))
    assert out.shape == q.shape and out.dtype == q.dtype
    k, v = case.decoded_kv()
    vis = paged_visible(positions, kv_lens, t, k.shape[1])
    want = np_codecs.attention(q.astype(np.float32), k, v, vis, 1.0 / np.sqrt(head_dim))
    got = np.asarray(out).astype(np.float32)
    assert np.isfinite(got).all(), "poison leaked into the output"
    tol = 2e-5 if q_dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert not got[1].any(), "a row with kv_len 0 must return exact zeros"


def test_paged_attention_sm_scale_and_no_visible_key():
    """Explicit sm_scale; queries placed before key 0 of a short row see keys j <= pos + t only."""
    kv_lens = np.array([70, 5], np.int32)
    positions = np.array([64, 0], np.int32)
    case = make_paged_case("int8-g64", "page-major", kv_lens=kv_lens, seed=3)
    q = np.random.default_rng(2).standard_normal((2, 3, 4, 64)).astype(np.float32)
    out = jax.jit(lambda *a: ops.paged_attention(*a, sm_scale=0.3, impl="reference"))(
        jnp.asarray(q), case.view(), jnp.asarray(case.table_rows), jnp.asarray(positions), jnp.asarray(kv_lens)
    )
    k, v = case.decoded_kv()
    want = np_codecs.attention(q, k, v, paged_visible(positions, kv_lens, 3, k.shape[1]), 0.3)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


def _append_planes(planes, tables, layer, rows, pos, k, v, valid, *, layout):
    view = PagedKVBatchLayerView(planes, tables, layer, layout)
    return ops.paged_append(view, rows, pos, k, v, valid, impl="reference").planes


_append = jax.jit(_append_planes, static_argnames="layout", donate_argnums=0)  # planes donated: in place


_DEFAULT_APPEND = {("bf16", "head-major"), ("int8-g64", "page-major"), ("nvfp4-g16", "head-major"), ("k8v4", "page-major")}


@pytest.mark.parametrize("profile,order", [
    pytest.param(p, o, id=f"{p.value}-{o.value}", marks=() if (p.value, o.value) in _DEFAULT_APPEND else (pytest.mark.slow,))
    for p in PROFILES for o in ORDERS
])
def test_paged_append_writes_exactly_the_codes(profile, order):
    t = 3 if profile in (KVProfile.BF16, KVProfile.NVFP4_G16, KVProfile.K8V4) else 64
    cap = 3 * P
    case = make_paged_case(profile, order, kv_lens=[cap] * 4, seed=11, fill_tokens=False, poison="bytes")
    rng = np.random.default_rng(4)
    # crosses a page boundary, writes nothing, writes part of the chunk, ends exactly at capacity
    positions = np.array([62 if t == 3 else 30, 10, 100, cap - t], np.int32)
    valid = np.array([t, 0, max(1, t - 2), t], np.int32)
    kv_dtype = ml_dtypes.bfloat16 if order is PlaneOrder.HEAD_MAJOR else np.float32
    k = (rng.standard_normal((4, t, 2, 64)) * 10.0 ** rng.integers(-3, 3, (4, t, 2, 1))).astype(kv_dtype)
    v = rng.standard_normal((4, t, 2, 64)).astype(kv_dtype)
    want = expected_paged_append(case, positions, np_codecs.encode_kv(profile.value, k, v), valid)
    view = case.view()
    args = [jnp.asarray(a) for a in (case.table_rows, positions, k, v, valid)]
    got = _append(view.planes, view.block_tables, view.layer, *args, layout=case.layout)
    for name in want:
        g, w = np.asarray(got[name]), want[name]
        diff = g.view(np.uint8) != w.view(np.uint8)
        assert not diff.any(), f"plane {name}: {int(diff.sum())} bytes differ, first at {np.argwhere(diff)[0]}"


def test_append_then_attend_roundtrip_with_traced_layer():
    """Append a chunk after a cached prefix, then attend over both, with the layer traced."""
    positions = np.array([50, 0], np.int32)  # row 0 continues mid page after 50 cached tokens
    case = make_paged_case("k8v4", "head-major", kv_lens=positions, mapped_tokens=[3 * P, 3 * P], seed=5)
    rng = np.random.default_rng(6)
    t = 40
    k = rng.standard_normal((2, t, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, t, 2, 64)).astype(np.float32)
    q = rng.standard_normal((2, t, 8, 64)).astype(np.float32)
    valid = np.array([t, 17], np.int32)
    kv_lens = positions + valid

    @jax.jit
    def step(view, layer, rows, pos, k, v, valid, q, lens):
        view = view.with_layer(layer)
        view = ops.paged_append(view, rows, pos, k, v, valid, impl="reference")
        return ops.paged_attention(q, view, rows, pos, lens, impl="reference")

    args = [jnp.asarray(a) for a in (case.table_rows, positions, k, v, valid, q, kv_lens)]
    out = np.asarray(step(case.view(), jnp.int32(case.layer), *args))
    pk, pv = case.decoded_kv()  # cached prefix tokens
    ck, cv = np_codecs.decode_kv("k8v4", np_codecs.encode_kv("k8v4", k, v))  # appended chunk
    for b in range(2):
        kk = np.concatenate([pk[b, : positions[b]], ck[b]])[None]
        vv = np.concatenate([pv[b, : positions[b]], cv[b]])[None]
        vis = paged_visible(positions[b : b + 1], kv_lens[b : b + 1], t, kk.shape[1])
        want = np_codecs.attention(q[b : b + 1], kk, vv, vis, 1 / 8.0)
        np.testing.assert_allclose(out[b : b + 1], want, rtol=2e-5, atol=2e-5)


def test_single_sequence_view_matches_batch_row():
    kv_lens = np.array([150], np.int32)
    case = make_paged_case("fp8-e4m3fn-row256", "page-major", kv_lens=kv_lens, extra_rows=1, seed=8)
    batch = case.view()
    single = PagedKVLayerView(batch.planes, batch.block_tables[int(case.table_rows[0])], case.layer, case.layout)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 2, 64)).astype(np.float32))
    pos, lens, valid = jnp.asarray([148], jnp.int32), jnp.asarray(kv_lens), jnp.asarray([2], jnp.int32)
    rows = jnp.asarray(case.table_rows)
    k = jnp.asarray(np.random.default_rng(1).standard_normal((1, 2, 2, 64)).astype(np.float32))

    @jax.jit
    def both(single, batch, rows):
        a = ops.paged_attention(q, single, None, pos, lens, impl="reference")
        b = ops.paged_attention(q, batch, rows, pos, lens, impl="reference")
        s = ops.paged_append(single, None, pos, k, k, valid, impl="reference")
        t = ops.paged_append(batch, rows, pos, k, k, valid, impl="reference")
        return a, b, s, t

    a, b, s, t = both(single, batch, rows)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(s, PagedKVLayerView)
    np.testing.assert_array_equal(np.asarray(s.block_table), np.asarray(single.block_table))
    for name in s.planes:
        np.testing.assert_array_equal(np.asarray(s.planes[name]).view(np.uint8), np.asarray(t.planes[name]).view(np.uint8))


# -- cyclic --------------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", [pytest.param("bf16", marks=pytest.mark.slow), "k8v4", pytest.param("int8-g64", marks=pytest.mark.slow)])
def test_cyclic_attention_matches_numpy(profile):
    window, t = 24, 3
    slots = window + t - 1
    written = np.array([40, 2, 26], np.int32)  # wrapped ring, short row, just wrapped
    case = make_cyclic_case(profile, written=written, window=window, slots=slots, seed=2)
    positions = written - t
    positions[1] = 0
    kv_lens = written.copy()
    rows = np.array([2, 0, 1], np.int32)  # batch row b reads ring row rows[b]
    q = np.random.default_rng(3).standard_normal((3, t, 4, 64)).astype(np.float32)
    attend = jax.jit(lambda *a: ops.cyclic_attention(*a, impl="reference"))
    out = attend(jnp.asarray(q), case.view(), jnp.asarray(rows), jnp.asarray(positions[rows]), jnp.asarray(kv_lens[rows]))
    k, v = np_codecs.decode_kv(profile, case.token_codes)  # (rows, total, H, D)
    jn = k.shape[1]
    for b, r in enumerate(rows):
        qpos = positions[r] + np.arange(t)
        j = np.arange(jn)
        vis = (j[None] <= qpos[:, None]) & (j[None] > qpos[:, None] - window) & (j[None] < kv_lens[r])
        want = np_codecs.attention(q[b : b + 1], k[r : r + 1], v[r : r + 1], vis[None], 1 / 8.0)
        np.testing.assert_allclose(np.asarray(out[b : b + 1]), want, rtol=2e-5, atol=2e-5)


def test_cyclic_append_writes_exactly_the_slots():
    window = slots = 16
    case = make_cyclic_case("nvfp4-g16", written=[0, 0, 0], window=window, slots=slots, seed=4)
    rng = np.random.default_rng(9)
    t = 20  # longer than the ring: only the last `slots` tokens of a row survive
    k = rng.standard_normal((3, t, 2, 64)).astype(np.float32)
    v = rng.standard_normal((3, t, 2, 64)).astype(np.float32)
    rows = np.array([1, 2, 0], np.int32)
    positions = np.array([5, 30, 0], np.int32)
    valid = np.array([t, 3, 0], np.int32)
    append = jax.jit(lambda *a: ops.cyclic_append(*a, impl="reference"))
    out = append(case.view(), jnp.asarray(rows), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid))
    enc = np_codecs.encode_kv("nvfp4-g16", k, v)
    want = {name: x.copy() for name, x in case.planes.items()}
    for b in range(3):
        for tt in range(valid[b]):
            pos = positions[b] + tt
            for name in want:
                want[name][case.layer, rows[b], :, pos % slots, :] = enc[name][b, tt]
    for name in want:
        np.testing.assert_array_equal(np.asarray(out.planes[name]).view(np.uint8), want[name].view(np.uint8))
