"""paged_append stores exactly the oracle's codes where the rules put them and changes no other bit.

Every backend appends into pools poisoned with random bytes (NaN payloads included), on pages in
random physical order behind shuffled table rows, with the layer traced; after every call each
plane must equal the numpy model (:mod:`.np_ops`) bit for bit: the oracle's codes at (layer, page,
head, column) of every written token, every other byte as it was.  Inputs: random values over
many binades, odd values and rounding ties (:mod:`.value_rows`), arbitrary rows (hypothesis).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from . import backends, np_ops
from .cases import (
    ORDERS,
    PAGE,
    PROFILES,
    AppendGeometry,
    append_case,
    append_geometry,
    pow2_head_dim,
    random_kv,
    richest_profile,
    tail_head_dim,
)
from .checks import assert_same_planes, raw_bits
from .value_rows import value_rows


def _append_and_check(backend: str, case, positions, k, v, valid, what: str) -> dict:
    """One jitted append; asserts the planes equal the model's; returns them."""
    got = backends.paged_append(backend, case.view(), case.table_rows, positions, k, v, valid)
    want = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, case.table_rows, positions,
                               k, v, valid)
    assert_same_planes(got, want, f"{backend} {case.layout.profile.value} {what}")
    return got


def _profile_orders():
    """Every (profile, order): the profile's default order runs by default, the other with -m slow."""
    for p, o in itertools.product(PROFILES, ORDERS):
        marks = () if o is append_geometry(p).order else (pytest.mark.slow,)
        yield pytest.param(p, o, id=f"{p.value}-{o.value}", marks=marks)


@pytest.mark.parametrize("profile,order", list(_profile_orders()))
def test_append_sequence_writes_exactly_the_oracle_codes(backend, profile, order):
    """Four steps of one shape (T = 5, K/V in the geometry's dtype): a chunk that crosses a page
    boundary mid-page while another row writes nothing, a decode step of one token per row, a
    partial chunk crossing the next boundary, and a last step ending exactly at capacity."""
    g = append_geometry(profile, order)
    case = append_case(g, seed=PROFILES.index(profile))
    rng = np.random.default_rng(11)
    cap = g.logical_pages * PAGE
    positions = np.array([60, 0, 125, cap - 11], np.int64)
    steps = ([5, 3, 0, 5], [1, 1, 1, 1], [0, 1, 5, 0], [2, 5, 4, 5])
    for i, valid in enumerate(steps):
        k, v = random_kv(rng, (g.batch, g.t, g.heads, g.head_dim), dtype=g.kv_dtype, spread=True)
        writes = np_ops.paged_writes(case.block_tables, case.table_rows, positions, valid, g.t, case.num_pages)
        assert len(writes) == sum(valid), "every token of this sequence is in range"
        before = case.planes
        case.planes = _append_and_check(backend, case, positions, k, v, valid, f"step {i}")
        assert any((raw_bits(before[n]) != raw_bits(case.planes[n])).any() for n in before), "the step wrote nothing"
        positions = positions + np.asarray(valid)
    assert positions[3] == cap


@pytest.mark.parametrize(
    "profile", [pytest.param(p, id=p.value, marks=() if p is richest_profile() else (pytest.mark.slow,)) for p in PROFILES]
)
def test_a_chunk_spanning_three_pages(backend, profile):
    """One call of 70 tokens from position 60 writes into blocks 0, 1 and 2; a second row ends mid-page."""
    g = dataclasses.replace(append_geometry(profile), batch=2, t=70)
    k, v = random_kv(np.random.default_rng(12), (g.batch, g.t, g.heads, g.head_dim), dtype=g.kv_dtype, spread=True)
    _append_and_check(backend, append_case(g, seed=13), [60, 0], k, v, [70, 65], "70-token chunk")


def _value_inputs(g: AppendGeometry, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K = the rows, V = the rows reversed and negated, tiled over (B, T, H) in the geometry's dtype."""
    x = np.resize(rows, (g.batch * g.t * g.heads, g.head_dim)).reshape(g.batch, g.t, g.heads, g.head_dim)
    y = -np.resize(rows[::-1], x.shape)
    dtype = jnp.dtype(g.kv_dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(dtype), y.astype(dtype)


_VALUE_POSITIONS = (62, 0, 130, 64)  # two rows cross a page boundary


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_odd_values_and_rounding_ties_store_the_oracle_bits(backend, profile):
    """NaN (payloads, both signs), +-inf, subnormals, +-0, values near float32 max and every rounding
    tie of the codecs store the oracle's codes and scales, NaN bits included.  Profiles whose
    geometry takes bfloat16 K/V see the same rows rounded to bfloat16."""
    g = append_geometry(profile)
    rows = value_rows(g.head_dim)
    assert rows.shape[0] <= g.batch * g.t * g.heads, "every row must be stored once"
    k, v = _value_inputs(g, rows)
    _append_and_check(backend, append_case(g, seed=3), _VALUE_POSITIONS, k, v, [g.t] * g.batch, "value rows")


_ELEMENT = st.floats(-1e6, 1e6, width=32, allow_subnormal=True) | st.sampled_from(
    [0.0, -0.0, 0.25, 0.75, 1.25, 2.5, 5.0, 448.0, 127.5, 1e-39, float("nan"), float("inf")]
)


@st.composite
def _profile_and_rows(draw):
    profile = draw(st.sampled_from(PROFILES))
    rows = draw(hnp.arrays(np.float32, (4, append_geometry(profile).head_dim), elements=_ELEMENT))
    return profile, rows


@settings(max_examples=8, deadline=None)
@given(profile_rows=_profile_and_rows())
def test_arbitrary_rows_store_the_oracle_bits(backend, profile_rows):
    """Rows drawn by hypothesis (finite over a wide range, ties, subnormals, NaN, inf) store the oracle's bits."""
    profile, rows = profile_rows
    g = append_geometry(profile)
    k, v = _value_inputs(g, rows)
    _append_and_check(backend, append_case(g, seed=5), _VALUE_POSITIONS, k, v, [g.t] * g.batch, "hypothesis rows")


def _sweep():
    for p, o, d_kind, heads, t in itertools.product(PROFILES, ORDERS, ("pow2", "tail", 256), (1, 8), (1, 3, 64)):
        d = {"pow2": pow2_head_dim(p), "tail": tail_head_dim(p)}.get(d_kind, d_kind)
        yield pytest.param(p, o, d, heads, t, id=f"{p.value}-{o.value}-d{d}-h{heads}-t{t}")


@pytest.mark.slow
@pytest.mark.parametrize("profile,order,head_dim,heads,t", list(_sweep()))
def test_append_sweep(backend, profile, order, head_dim, heads, t):
    """Wide sweep: every profile and order, head dims 64 / non-power-of-two / 256, 1 or 8 KV heads,
    chunks of 1, 3 and 64 tokens (one row crossing pages, one writing nothing, one partial)."""
    g = AppendGeometry(profile, order, head_dim, "float32", batch=3, t=t, heads=heads)
    k, v = random_kv(np.random.default_rng(t), (g.batch, t, heads, head_dim), spread=True)
    _append_and_check(backend, append_case(g, seed=head_dim + heads + t), [63, 0, 120], k, v, [t, 0, max(1, t - 1)],
                      "sweep")
