"""paged_attention agrees with the float64 numpy model and never reads poison.

Pools are poisoned with NaN (module docstring of :mod:`.cases`): unused pages, columns past each
row's frontier, the other layer, junk table entries past each row's blocks.  The output must be
finite and within :func:`.checks.attention_tolerance` of the model (float32 queries 2e-5;
bfloat16 queries 2**-8 for backends that round a float32 result, 2e-2 for bfloat16 products).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.ops.views import PagedKVLayerView

from . import backends, np_codecs, np_ops
from .cases import (
    ORDERS,
    PAGE,
    PROFILES,
    AttentionGeometry,
    append_geometry,
    attention_case,
    attention_geometry,
    make_paged_case,
    pow2_head_dim,
    random_kv,
    richest_profile,
    tail_head_dim,
)
from .checks import assert_attention_close, assert_same_planes, attention_tolerance


def _rows(t: int, cap: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """kv_lens / positions of 4 rows: a chunk ending at a mid-page frontier, a row with no key,
    queries past a short row's frontier (they see all its keys), a chunk ending at capacity."""
    mid = int(rng.integers(t + 1, cap - PAGE)) | 1
    kv_lens = np.array([mid, 0, int(rng.integers(1, 40)), cap])
    positions = np.array([mid - t, int(rng.integers(0, 5)), int(rng.integers(45, 100)), cap - t])
    return kv_lens, positions


def _queries(g: AttentionGeometry, rng) -> np.ndarray:
    q = rng.standard_normal((g.batch, g.t, g.heads * g.group, g.head_dim)).astype(np.float32)
    return q.astype(jnp.dtype(g.q_dtype))


def _check(backend: str, g: AttentionGeometry, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kv_lens, positions = _rows(g.t, g.logical_pages * PAGE, rng)
    case = attention_case(g, kv_lens, seed=seed)
    q = _queries(g, rng)
    got = backends.paged_attention(backend, q, case.view(), case.table_rows, positions, kv_lens, g.sm_scale)
    want = np_ops.paged_attention(backends.queries_as_seen(backend, case.layout.profile, q), case.planes, case.layout, case.layer, case.block_tables, case.table_rows,
                                  positions, kv_lens, g.sm_scale)
    out = assert_attention_close(got, want, backend=backend, q_dtype=g.q_dtype, what=str(g))
    assert not out[1].any(), "a row with kv_len 0 must return exact zeros"
    return out


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_attention_matches_the_oracle(backend, profile):
    """The profile's default geometry: its plane order, head dim, GQA group (1, 4 or 8), query
    length (1, 3 or 64), query dtype and sm_scale (default or explicit) rotate over the profiles."""
    _check(backend, attention_geometry(profile), seed=PROFILES.index(profile))


def _sweep():
    for (p, o, (group, t)), q_dtype in itertools.product(
        itertools.product(PROFILES, ORDERS, itertools.product((1, 4, 8), (1, 3, 64))), ("float32", "bfloat16")
    ):
        g = AttentionGeometry(p, o, pow2_head_dim(p) * (2 if t == 3 else 1), group, t, q_dtype, None)
        yield pytest.param(g, id=f"{p.value}-{o.value}-g{group}-t{t}-d{g.head_dim}-{q_dtype}")


@pytest.mark.slow
@pytest.mark.parametrize("geometry", list(_sweep()))
def test_attention_sweep(backend, geometry):
    """Wide sweep: every profile, order, GQA group 1/4/8, query length 1/3/64 and query dtype."""
    _check(backend, geometry, seed=geometry.t + geometry.group)


def test_long_context(backend):
    """A row of 3000 keys over 48 pages (context splits where a backend makes them) beside a short
    row, with a head dim that leaves a scalar tail after the vector lanes."""
    profile = PROFILES[0]
    d = tail_head_dim(profile)
    kv_lens, positions = np.array([3000, 70]), np.array([2998, 68])
    case = make_paged_case(profile, ORDERS[1], kv_lens=kv_lens, heads=1, head_dim=d, logical_pages=48,
                           num_layers=1, layer=0, seed=1)
    q = np.random.default_rng(2).standard_normal((2, 2, 4, d)).astype(np.float32)
    got = backends.paged_attention(backend, q, case.view(), case.table_rows, positions, kv_lens)
    want = np_ops.paged_attention(backends.queries_as_seen(backend, case.layout.profile, q), case.planes, case.layout, case.layer, case.block_tables, case.table_rows,
                                  positions, kv_lens)
    assert_attention_close(got, want, backend=backend, q_dtype=np.float32, what="long context")


def _nan_planes(layout, tensor: str) -> list[tuple[str, list[int]]]:
    """Planes of ``tensor`` that can hold a NaN, with two raw NaN patterns (both signs) of each:
    bfloat16 codes or scales, e4m3fn codes, NVFP4 scale bytes (packed e2m1 and int8 codes have none)."""
    out = []
    for name in layout.plane_names:
        spec = layout.plane(name)
        if spec.tensor != tensor:
            continue
        if spec.dtype == np_codecs.BF16:
            out.append((name, [0x7FC1, 0xFFC0]))
        elif spec.dtype == np_codecs.E4M3 or (spec.role == "scale" and spec.dtype == np.uint8):
            out.append((name, [0x7F, 0xFF]))
    return out


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_nan_stored_in_a_visible_key_reaches_exactly_the_outputs_that_read_it(backend, profile):
    """Raw NaN bit patterns written into the planes (as a corrupted or hand-edited pool holds them):
    in a value code or scale of one key, in a key code or scale of another; every query of the row
    sees those keys.  A value NaN lands in its columns of the query heads that read that KV head, a
    key NaN turns those heads' whole outputs into NaN, and every other output stays within tolerance."""
    g = attention_geometry(profile)
    rng = np.random.default_rng(31)
    kv_lens = np.array([150, 100, 90, 0])
    positions = kv_lens - g.t
    positions[3] = 0
    case = attention_case(g, kv_lens, seed=31)
    lay, layer, j = case.layout, case.layer, 3  # key 3 is visible to every query of rows 0-2

    def poke(b: int, name: str, head: int, element: int, bits: int) -> None:
        page = int(case.block_tables[case.table_rows[b], j // PAGE])
        plane = case.planes[name]
        raw = plane.view(np.uint16 if plane.dtype.itemsize == 2 else np.uint8)
        if lay.order is PlaneOrder.PAGE_MAJOR:
            raw[layer, page, head, j % PAGE, element] = bits
        else:
            raw[layer, head, page, j % PAGE, element] = bits

    (v_name, v_bits), (k_name, k_bits) = _nan_planes(lay, "v")[0], _nan_planes(lay, "k")[0]
    poke(0, v_name, 0, 0, v_bits[0])
    poke(1, v_name, 1, case.planes[v_name].shape[-1] - 1, v_bits[1])
    poke(2, k_name, 1, 0, k_bits[0])
    q = _queries(g, rng)
    got = backends.paged_attention(backend, q, case.view(), case.table_rows, positions, kv_lens, g.sm_scale)
    want = np_ops.paged_attention(backends.queries_as_seen(backend, lay.profile, q), case.planes, lay, layer, case.block_tables, case.table_rows, positions, kv_lens,
                                  g.sm_scale)
    nan = np.isnan(want)
    heads0 = slice(0, g.group)  # the query heads of KV head 0
    assert nan[0, :, heads0].any() and not nan[0].all() and nan[1].any() and nan[2].all(axis=-1)[:, g.group:].all()
    assert not nan[2, :, heads0].any() and not nan[3].any()
    got32 = np.asarray(got).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got32), nan, err_msg=f"{backend}: NaN outputs differ from the oracle's")
    np.testing.assert_allclose(got32[~nan], want[~nan], **attention_tolerance(backend, g.q_dtype))


def test_append_then_attend_round_trip(backend):
    """A chunk appended after a cached prefix (mid page, at 0, across a page boundary, at a short
    row) is what the same backend's attention then reads, together with the prefix."""
    profile = richest_profile()
    g = append_geometry(profile)
    full = [g.logical_pages * PAGE] * g.batch
    prefix = np.array([50, 0, 126, 7])
    case = make_paged_case(profile, g.order, kv_lens=prefix, mapped_tokens=full, heads=g.heads, head_dim=g.head_dim,
                           logical_pages=g.logical_pages, seed=5)
    rng = np.random.default_rng(6)
    k, v = random_kv(rng, (g.batch, g.t, g.heads, g.head_dim), dtype=g.kv_dtype)
    valid = np.array([5, 3, 5, 1])
    planes = backends.paged_append(backend, case.view(), case.table_rows, prefix, k, v, valid)
    want_planes = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, case.table_rows,
                                      prefix, k, v, valid)
    assert_same_planes(planes, want_planes, f"{backend} round-trip append")
    q = rng.standard_normal((g.batch, g.t, 4 * g.heads, g.head_dim)).astype(np.float32)
    kv_lens = prefix + valid
    got = backends.paged_attention(backend, q, case.view(planes), case.table_rows, prefix, kv_lens)
    want = np_ops.paged_attention(backends.queries_as_seen(backend, case.layout.profile, q), want_planes, case.layout, case.layer, case.block_tables, case.table_rows, prefix,
                                  kv_lens)
    assert_attention_close(got, want, backend=backend, q_dtype=np.float32, what="round trip")


def test_single_sequence_view_matches_its_batch_row(backend):
    """A PagedKVLayerView of table row r gives exactly what a batch view gives with every batch row on r."""
    profile = PROFILES[0]
    ga, gq = append_geometry(profile), attention_geometry(profile)
    rng = np.random.default_rng(8)
    for what, g in (("append", ga), ("attention", gq)):
        case = attention_case(g, [150, 0, 0, 0], seed=8)
        r = int(case.table_rows[0])
        batch = case.view()
        single = PagedKVLayerView(batch.planes, batch.block_tables[r], batch.layer, case.layout)
        rows = np.full(g.batch, r)
        if what == "append":
            positions, valid = np.array([150, 160, 190, 0]), np.array([5, 5, 2, 5])
            k, v = random_kv(rng, (g.batch, g.t, g.heads, g.head_dim), dtype=g.kv_dtype)
            a = backends.paged_append(backend, batch, rows, positions, k, v, valid)
            s = backends.jitted(backend, "paged_append")(single, None, positions, jnp.asarray(k), jnp.asarray(v), valid)
            assert isinstance(s, PagedKVLayerView)
            assert_same_planes({n: np.asarray(x) for n, x in s.planes.items()}, a, f"{backend} single-sequence append")
        else:
            positions, kv_lens = np.array([140, 100, 149, 20]), np.array([150, 101, 150, 21])
            q = _queries(g, rng)
            a = backends.paged_attention(backend, q, batch, rows, positions, kv_lens, g.sm_scale)
            s = backends.jitted(backend, "paged_attention")(jnp.asarray(q), single, None, positions, kv_lens,
                                                             sm_scale=g.sm_scale)
            np.testing.assert_array_equal(np.asarray(jax.device_get(s)), a, err_msg=f"{backend} single-sequence attention")
