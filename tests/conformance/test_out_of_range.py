"""Out-of-range indices under jit follow one set of rules in every backend; concrete ones are rejected.

Under ``jax.jit`` nothing can be checked, and every backend must do what :mod:`.np_ops` models:

* a table row (or ring row) outside its range makes the batch row inert: no write, zeros out;
* a table entry outside ``[0, N)`` (``-1``, ``N``, ``INT32_MAX``) drops the appended tokens of its
  block and hides its keys from attention;
* positions outside ``[0, L * 64)`` are dropped by appends, negative ring positions too; ``valid``
  is clipped to ``[0, T]``; attention reads ``clip(kv_lens, 0, L * 64)`` keys, and a query at a
  negative position sees no key.

Each scenario states how many tokens the rules write (or which outputs are zero), so the model
itself is held to the rules; the backends must then match it bit for bit (planes) or within the
attention tolerance.  The same indices given concretely raise ``ValueError`` before anything runs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops

from . import backends, np_ops
from .cases import (
    INT32_MAX,
    PAGE,
    PROFILES,
    append_case,
    append_geometry,
    attention_case,
    attention_geometry,
    cyclic_geometry,
    make_cyclic_case,
    random_kv,
    richest_profile,
)
from .checks import assert_attention_close, assert_same_planes, raw_bits

# The default run takes the profile with both kinds of scale plane; -m slow takes every profile.
_PROFILES = [pytest.param(p, id=p.value, marks=() if p is richest_profile() else (pytest.mark.slow,)) for p in PROFILES]


@pytest.mark.parametrize("profile", _PROFILES)
def test_paged_append_drops_what_the_rules_drop(backend, profile):
    """Inert table rows, entries -1 / N / INT32_MAX inside the written span, positions before 0 and
    past L * 64, valid above T and below 0: exactly the tokens the rules keep are written."""
    g = append_geometry(profile)
    case = append_case(g, seed=21)
    c, n, cap = case.block_tables.shape[0], case.num_pages, g.logical_pages * PAGE
    r0, r1, r2, r3 = (int(r) for r in case.table_rows)
    case.block_tables[r1, 1] = -1
    case.block_tables[r2, 0] = n
    case.block_tables[r3, 2] = INT32_MAX
    scenarios = [
        # rows C+1 and -1 inert; r1 writes 62, 63 and drops block 1; r2 drops 63, valid 9 -> 5 writes 64..67
        ([c + 1, r1, r2, -1], [0, 62, 63, 0], [5, 5, 9, 5], 2 + 4),
        # r0 from -2: drops -2, -1, writes 0..2; r0 at capacity: writes 190, 191, drops 192..194;
        # r3 into its INT32_MAX block: nothing; r1 with valid -3: nothing
        ([r0, r0, r3, r1], [-2, cap - 2, 2 * PAGE, 10], [5, 5, 5, -3], 3 + 2),
    ]
    rng = np.random.default_rng(22)
    for rows, positions, valid, writes in scenarios:
        assert len(np_ops.paged_writes(case.block_tables, rows, positions, valid, g.t, n)) == writes
        k, v = random_kv(rng, (g.batch, g.t, g.heads, g.head_dim), dtype=g.kv_dtype)
        got = backends.paged_append(backend, case.view(), rows, positions, k, v, valid)
        want = np_ops.paged_append(case.planes, case.layout, case.layer, case.block_tables, rows, positions, k, v, valid)
        assert_same_planes(got, want, f"{backend} {profile.value} rows {rows}")


@pytest.mark.parametrize("profile", _PROFILES)
def test_paged_attention_masks_what_the_rules_mask(backend, profile):
    """Holes (-5, INT32_MAX, N) inside a row's keys, kv_len past L * 64 or negative, inert table rows
    and queries before position 0: the output is the model's, zeros where no key is visible."""
    g = attention_geometry(profile)
    cap = g.logical_pages * PAGE
    case = attention_case(g, [130, cap, 64, 20], seed=23)
    c, n = case.block_tables.shape[0], case.num_pages
    r0, r1, r2, r3 = (int(r) for r in case.table_rows)
    holes = case.block_tables.copy()
    holes[r0, 1] = -5  # keys 64..127 of r0 hidden
    holes[r0, 2] = INT32_MAX  # keys 128, 129 of r0 hidden
    holes[r2, 0] = n  # every key of r2 hidden
    rng = np.random.default_rng(24)
    scenarios = [
        # r0 with holes; r1 with kv_len past L * 64 (clipped: every key of r1 is real); r1 with queries
        # from 2 - T (those before 0 see nothing); r2 with every key hidden
        ([r0, r1, r1, r2], [129, cap - 1, 2 - g.t, 63], [130, 10**6, cap, 64]),
        # C + 3 and -1 inert; r3 with a negative kv_len; r3 with every query before 0
        ([c + 3, -1, r3, r3], [10, 10, 19, -(g.t + 2)], [20, 20, -7, 20]),
    ]
    zero_rows = ([3], [0, 1, 2, 3])
    for (rows, positions, kv_lens), zeros in zip(scenarios, zero_rows):
        q = rng.standard_normal((g.batch, g.t, g.heads * g.group, g.head_dim)).astype(np.float32)
        q = q.astype(jnp.dtype(g.q_dtype))
        got = backends.paged_attention(backend, q, case.view(block_tables=holes), rows, positions, kv_lens, g.sm_scale)
        want = np_ops.paged_attention(backends.queries_as_seen(backend, case.layout.profile, q), case.planes, case.layout, case.layer, holes, rows, positions, kv_lens,
                                      g.sm_scale)
        out = assert_attention_close(got, want, backend=backend, q_dtype=g.q_dtype, what=f"rows {rows}")
        before_zero = (np.asarray(positions)[:, None] + np.arange(g.t)) < 0  # (B, T): queries before position 0
        for b in range(g.batch):
            silent = np.ones(g.t, bool) if b in zeros else before_zero[b]
            assert not want[b, silent].any() and want[b, ~silent].any(axis=(1, 2)).all(), f"model, batch row {b}"
            assert not out[b, silent].any(), f"{backend}: batch row {b}, queries {np.flatnonzero(silent)} must be zeros"
    # the holes change what row r0 sees: the model without them differs
    full = np_ops.paged_attention(q[:1], case.planes, case.layout, case.layer, case.block_tables, [r0], [129], [130])
    with_holes = np_ops.paged_attention(q[:1], case.planes, case.layout, case.layer, holes, [r0], [129], [130])
    assert not np.allclose(full, with_holes)


@pytest.mark.parametrize("profile", _PROFILES)
def test_cyclic_rows_positions_and_valid_follow_the_rules(backend, profile):
    """Ring rows outside the state are inert, negative positions dropped, valid clipped to [0, T];
    attention of an inert ring is zeros and a query before position 0 sees no key."""
    ga = cyclic_geometry(profile, "append")
    case = make_cyclic_case(ga, seed=25, poison="bytes")
    rows_state = ga.rows
    rng = np.random.default_rng(26)
    scenarios = [
        # ring rows 4 (= rows) and -1 inert; ring 1 from -3: drops -3..-1, valid 20 -> 11: writes 0..7
        ([rows_state, -1, 1], [0, 0, -3], [11, 11, 20], {1}),
        # valid -2 writes nothing; ring 2 writes 3 tokens; ring 3 valid 0
        ([0, 2, 3], [5, 0, 0], [-2, 3, 0], {2}),
    ]
    for rows, positions, valid, written in scenarios:
        k, v = random_kv(rng, (3, 11, ga.heads, ga.head_dim))
        got = backends.cyclic_append(backend, case.view(), rows, positions, k, v, valid)
        want = np_ops.cyclic_append(case.planes, case.layout, case.layer, rows, positions, k, v, valid)
        changed = {r for r in range(rows_state) if any((raw_bits(want[n][:, r]) != raw_bits(case.planes[n][:, r])).any()
                                                       for n in want)}
        assert changed == written, f"the model wrote rings {changed}"
        assert_same_planes(got, want, f"{backend} {profile.value} cyclic rows {rows}")
    gq = cyclic_geometry(profile, "attention")
    p = attention_geometry(profile)
    case = make_cyclic_case(gq, written=[30, 30, 30], seed=27)
    q = rng.standard_normal((3, 5, 4 * gq.heads, gq.head_dim)).astype(np.float32)
    q = q.astype(jnp.dtype(p.q_dtype))
    rows, positions, kv_lens = [gq.rows, -2, 1], [20, 20, -2], [30, 30, 30]  # inert, inert, queries -2..2
    got = backends.cyclic_attention(backend, q, case.view(), rows, positions, kv_lens, p.sm_scale)
    want = np_ops.cyclic_attention(backends.queries_as_seen(backend, case.layout.profile, q), case.planes, case.layout, case.layer, rows, positions, kv_lens, p.sm_scale)
    out = assert_attention_close(got, want, backend=backend, q_dtype=p.q_dtype, what="cyclic out of range")
    silent = np.zeros((3, 5), bool)
    silent[:2] = True
    silent[2, :2] = True  # queries at -2 and -1
    assert not want[silent].any() and want[~silent].any(axis=(1, 2)).all()
    assert not out[silent].any(), f"{backend}: inert rings and negative positions must return exact zeros"


def test_the_same_indices_given_concretely_are_rejected(backend):
    """With concrete inputs the front end checks every range before any backend runs."""
    g = append_geometry(richest_profile())
    case = append_case(g, seed=28)
    view = case.view()
    c, r1 = case.block_tables.shape[0], int(case.table_rows[1])
    k, v = random_kv(np.random.default_rng(29), (g.batch, g.t, g.heads, g.head_dim))
    rows = case.table_rows
    zeros = np.zeros(g.batch, np.int32)
    with pytest.raises(ValueError, match=rf"table_rows\[0\]={c + 1} is out of range; allowed: \[0, C={c}\)"):
        ops.paged_append(view, [c + 1, *rows[1:]], zeros, k, v, np.full(g.batch, g.t), impl=backend)
    with pytest.raises(ValueError, match=r"positions\[0\]=-2 is out of range"):
        ops.paged_append(view, rows, [-2, 0, 0, 0], k, v, np.full(g.batch, g.t), impl=backend)
    with pytest.raises(ValueError, match=r"valid\[1\]=9 is out of range"):
        ops.paged_append(view, rows, zeros, k, v, [5, 9, 5, 5], impl=backend)
    tables = case.block_tables.copy()
    tables[r1, 1] = -1
    bad = case.view(block_tables=tables)
    with pytest.raises(ValueError, match=rf"block_tables\[{r1}, 1\] = -1 \(table row {r1} = table_rows\[1\], logical block 1\)"):
        ops.paged_append(bad, rows, [0, 62, 0, 0], k, v, np.full(g.batch, g.t), impl=backend)
    q = np.zeros((g.batch, 1, 2 * g.heads, g.head_dim), np.float32)
    with pytest.raises(ValueError, match=rf"block_tables\[{r1}, 1\] = -1 .* whose entries must lie in \[0, N={case.num_pages}\)"):
        ops.paged_attention(q, bad, rows, zeros, [1, 100, 1, 1], impl=backend)
    cap = g.logical_pages * PAGE
    with pytest.raises(ValueError, match=rf"kv_lens\[1\]={cap + 8} is out of range; allowed: \[0, L\*P={cap}\]"):
        ops.paged_attention(q, view, rows, zeros, [1, cap + 8, 1, 1], impl=backend)
    with pytest.raises(ValueError, match=rf"positions\[3\] \+ valid\[3\] = {cap - 2} \+ 5 = {cap + 3} exceeds"):
        ops.paged_append(view, rows, [0, 0, 0, cap - 2], k, v, np.full(g.batch, g.t), impl=backend)
    ring = make_cyclic_case(cyclic_geometry(richest_profile(), "append"))
    k3, v3 = random_kv(np.random.default_rng(30), (3, 2, ring.layout.num_kv_heads, ring.layout.head_dim))
    with pytest.raises(ValueError, match=rf"rows\[2\]={ring.layout.rows} is out of range; allowed: \[0, rows={ring.layout.rows}\)"):
        ops.cyclic_append(ring.view(), [0, 1, ring.layout.rows], [0, 0, 0], k3, v3, [2, 2, 2], impl=backend)
