"""The suite's own tools: the oracle states the odd-value rules, the builder poisons what it claims,
the comparisons fail on a single wrong bit or an error just past the tolerance, and a backend that
cannot load is skipped with its reason."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.ops.registry import ImplUnavailableError, override_impls

from . import np_codecs, np_ops
from .backends import BACKENDS, require
from .cases import INT32_MAX, INT32_MIN, PAGE, PROFILES, attention_case, attention_geometry, plane_index
from .checks import assert_attention_close, assert_same_planes, raw_bits
from .value_rows import odd_rows


def test_the_oracle_states_the_odd_value_rules():
    """NaN groups store the canonical NaN scale and codes 0, inf an inf scale (INT8 / FP8) or 448
    (NVFP4), subnormal quotients and inputs flush to zero, BF16 keeps subnormals (docs/ACCURACY.md)."""
    x = odd_rows(64)
    code, scale = np_codecs.encode("int8-g64", x)
    s = raw_bits(scale)
    assert s[0, 0] == 0x7FC0 and s[1, 0] == 0x7FC0 and s[4, 0] == 0x7FC0  # NaN -> canonical NaN scale
    assert s[2, 0] == 0x7F80 and s[3, 0] == 0x7F80  # +-inf -> +inf scale
    assert not code[[0, 1, 2, 3, 4], :64].any()  # non-finite scale -> codes 0
    assert s[7, 0] == 0 and s[8, 0] == 0 and not code[[7, 8]].any()  # subnormal quotient flushed
    assert not code[9, ::2].any()  # subnormal inputs read as zero
    code, scale = np_codecs.encode("fp8-e4m3fn-row", x)
    assert raw_bits(scale)[0, 0] == 0x7FC0 and not raw_bits(code)[[0, 1, 2, 3, 4]].any()
    assert (raw_bits(code)[6] == 0).all()  # zero scale: +0 codes even for -0.0 inputs
    code, scale = np_codecs.encode("nvfp4-g16", x)
    assert scale[0, 0] == 0x7F and scale[1, 1] == 0x7F and scale[2, 0] == 0x7E  # NaN 0x7F; inf -> 448
    assert not code[0, :8].any() and not code[1, 8:16].any()
    assert code[2, 2] >> 4 == 0x7  # +inf (element 5: high nibble of byte 2) clips to +6 under the scale 448
    code, _ = np_codecs.encode("bf16", x)
    assert raw_bits(code)[0, 3] == 0x7FC0 and raw_bits(code)[1, 17] == 0x7FC0
    assert (raw_bits(code)[7] & 0x7F80 == 0).all() and raw_bits(code)[7].any()  # bf16 keeps subnormals


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_the_builder_poisons_everything_outside_the_tokens(profile):
    """Unused pages, columns past each frontier and the other layer hold NaN poison; every kind of
    junk table entry occurs; batch rows go through shuffled table rows."""
    g = attention_geometry(profile)
    case = attention_case(g, [70, 0, 130, 5], seed=1)
    n = case.num_pages
    k, _ = np_codecs.decode_kv(profile, {name: x for name, x in case.planes.items()})
    assert np.isnan(k[1 - case.layer]).all(), "the other layer must be poison"
    owned = set()
    for b, row in enumerate(case.table_rows):
        used = -(-int(case.kv_lens[b]) // PAGE)
        owned |= {int(p) for p in case.block_tables[row, :used]}
        if used:  # every row here ends mid-page
            last = np.array([case.block_tables[row, used - 1]])
            idx = plane_index(case.layout.order, case.layer, last, np.array([case.kv_lens[b] % PAGE]))
            col = np_codecs.decode_kv(profile, {name: x[idx] for name, x in case.planes.items()})[0]
            assert np.isnan(col).all(), "the column past a frontier must be poison"
    spare = sorted(set(range(n)) - owned)
    idx = plane_index(case.layout.order, case.layer, np.array(spare), np.zeros(len(spare), int))
    assert np.isnan(np_codecs.decode_kv(profile, {name: x[idx] for name, x in case.planes.items()})[0]).all()
    junk = set(case.block_tables.ravel().tolist()) - owned
    assert {n, n + 7, -1, INT32_MIN, INT32_MAX} <= junk and junk & set(spare), junk
    assert sorted(case.table_rows.tolist()) != list(range(len(case.table_rows)))


def test_the_plane_comparison_sees_one_flipped_nan_payload_bit():
    """A NaN whose payload differs in one bit is a difference; the message names the plane and the place."""
    planes = {"k": np.full((2, 3), np.nan, np_codecs.BF16), "k_scale": np.arange(6, dtype=np.uint8).reshape(2, 3)}
    other = {name: x.copy() for name, x in planes.items()}
    assert_same_planes(other, planes, "identical")
    other["k"].view(np.uint16)[1, 2] ^= 1  # still a NaN, another payload
    with pytest.raises(AssertionError, match=r"plane k: 1 of 6 elements differ; first at \(1, 2\)"):
        assert_same_planes(other, planes, "flipped")


def test_the_attention_comparison_fails_past_the_tolerance_and_on_nan():
    """A relative error of 1e-5 passes, 1e-4 off fails (float32 queries), and a NaN output fails."""
    want = np.linspace(-3, 3, 24).reshape(1, 2, 3, 4)
    assert_attention_close(want * (1 + 1e-5), want, backend="reference", q_dtype=np.float32)
    with pytest.raises(AssertionError):
        assert_attention_close(want + 1e-4, want, backend="reference", q_dtype=np.float32)
    bad = want.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(AssertionError, match="non-finite"):
        assert_attention_close(bad, want, backend="pallas", q_dtype=np.float32)


def test_the_model_of_the_rules_on_a_hand_example():
    """Hand-worked writes of the append rules: inert rows, dropped blocks, clipped valid, negative positions."""
    tables = np.array([[3, -1], [5, 2]], np.int32)  # C = 2, L = 2, N = 6
    writes = np_ops.paged_writes(tables, [0, 1, 2, -1, 1], [62, 126, 0, 0, -1], [4, 9, 3, 3, 2], t=4, num_pages=6)
    assert writes == [(0, 0, 3, 62), (0, 1, 3, 63), (1, 0, 2, 62), (1, 1, 2, 63), (4, 1, 5, 0)]


def test_an_unavailable_backend_is_skipped_with_its_reason():
    """A registered backend whose loader raises ImplUnavailableError is skipped, its reason in the message."""
    def loader():
        raise ImplUnavailableError("no such device here")

    assert set(BACKENDS) >= {"reference"}
    with override_impls({"absent": loader}):
        with pytest.raises(pytest.skip.Exception, match="backend 'absent' is unavailable here: no such device here"):
            require("absent")
    assert require("reference") == "reference"
