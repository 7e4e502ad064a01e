"""Closed KV profiles: the plane schema and the contract's D=256 byte table."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninfer_kv.schema.profiles import KVCodec, KVProfile

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
U8 = np.dtype(np.uint8)
I8 = np.dtype(np.int8)

# The contract's D=256 table: (K code, K scale, V code, V scale, total) bytes per (token, head).
D256_TABLE = {
    KVProfile.BF16: (512, 0, 512, 0, 1024),
    KVProfile.INT8_G64: (256, 8, 256, 8, 528),
    KVProfile.FP8_E4M3FN_ROW256: (256, 2, 256, 2, 516),
    KVProfile.NVFP4_G16: (128, 16, 128, 16, 288),
    KVProfile.K8V4: (256, 2, 128, 16, 402),
}


def _plane_bytes(profile, head_dim):
    return {p.name: p.token_head_bytes for p in profile.planes(head_dim)}


@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_d256_byte_table_matches_contract(profile):
    k_code, k_scale, v_code, v_scale, total = D256_TABLE[profile]
    planes = _plane_bytes(profile, 256)
    assert planes["k"] == k_code
    assert planes["v"] == v_code
    assert planes.get("k_scale", 0) == k_scale
    assert planes.get("v_scale", 0) == v_scale
    assert profile.tensor_bytes("k", 256) == k_code + k_scale
    assert profile.tensor_bytes("v", 256) == v_code + v_scale
    assert profile.token_head_bytes(256) == total


def test_d256_totals_as_written_in_the_contract():
    got = {p.value: (p.tensor_bytes("k", 256), p.tensor_bytes("v", 256), p.token_head_bytes(256)) for p in KVProfile}
    assert got == {
        "bf16": (512, 512, 1024),
        "int8-g64": (264, 264, 528),
        "fp8-e4m3fn-row256": (258, 258, 516),
        "nvfp4-g16": (144, 144, 288),
        "k8v4": (258, 144, 402),
    }


# (name, dtype, extent X, group) per plane, for a head dim D.
def _expected_schema(profile, d):
    bf16 = [("k", BF16, d, 1), ("v", BF16, d, 1)]
    int8 = [("k", I8, d, 64), ("k_scale", BF16, d // 64, 64), ("v", I8, d, 64), ("v_scale", BF16, d // 64, 64)]
    fp8_k = [("k", E4M3, d, d), ("k_scale", BF16, 1, d)]
    fp8_v = [("v", E4M3, d, d), ("v_scale", BF16, 1, d)]
    fp4_k = [("k", U8, d // 2, 16), ("k_scale", U8, d // 16, 16)]
    fp4_v = [("v", U8, d // 2, 16), ("v_scale", U8, d // 16, 16)]
    return {
        KVProfile.BF16: bf16,
        KVProfile.INT8_G64: int8,
        KVProfile.FP8_E4M3FN_ROW256: fp8_k + fp8_v,
        KVProfile.NVFP4_G16: fp4_k + fp4_v,
        KVProfile.K8V4: fp8_k + fp4_v,
    }[profile]


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_plane_schema(profile, head_dim):
    planes = profile.planes(head_dim)
    got = [(p.name, p.dtype, p.extent, p.group) for p in planes]
    assert got == _expected_schema(profile, head_dim)
    assert profile.plane_names() == tuple(p.name for p in planes)
    for p in planes:
        assert p.tensor == p.name[0]
        assert p.role == ("scale" if p.name.endswith("_scale") else "data")
        assert p.codec is profile.codec(p.tensor)
        assert p.to_json() == {
            "name": p.name,
            "dtype": p.dtype.name,
            "extent": p.extent,
            "group": p.group,
            "bytes": p.extent * p.dtype.itemsize,
        }


def test_k8v4_is_asymmetric():
    p = KVProfile.K8V4
    assert p.k_codec is KVCodec.FP8_E4M3FN_ROW
    assert p.v_codec is KVCodec.NVFP4_G16
    assert p.tensor_bytes("k", 256) != p.tensor_bytes("v", 256)
    assert p.token_head_bytes(256) != 2 * p.tensor_bytes("k", 256)
    assert p.token_head_bytes(256) != 2 * p.tensor_bytes("v", 256)


def test_no_float16_anywhere():
    for profile in KVProfile:
        for d in (64, 256):
            assert all(p.dtype != np.float16 for p in profile.planes(d))


@pytest.mark.parametrize(
    "profile, head_dim, needs",
    [
        ("int8-g64", 96, "% 64"),
        ("int8-g64", 32, "% 64"),
        ("nvfp4-g16", 40, "% 16"),
        ("nvfp4-g16", 8, "% 16"),
        ("k8v4", 40, "% 16"),
    ],
)
def test_unsupported_head_dim_names_profile_and_d(profile, head_dim, needs):
    p = KVProfile.parse(profile)
    for call in (lambda: p.planes(head_dim), lambda: p.check_head_dim(head_dim), lambda: p.token_head_bytes(head_dim)):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert profile in msg and f"head_dim={head_dim}" in msg and needs in msg


@pytest.mark.parametrize("head_dim", [0, -64, 1.5, True, "256"])
@pytest.mark.parametrize("profile", list(KVProfile), ids=lambda p: p.value)
def test_invalid_head_dim_is_a_value_error(profile, head_dim):
    with pytest.raises(ValueError, match=f"profile {profile.value}: head_dim="):
        profile.planes(head_dim)


@pytest.mark.parametrize("head_dim", [1, 40, 96, 100, 200])
def test_bf16_and_fp8_row_accept_any_positive_head_dim(head_dim):
    assert KVProfile.BF16.token_head_bytes(head_dim) == 4 * head_dim
    assert KVProfile.FP8_E4M3FN_ROW256.token_head_bytes(head_dim) == 2 * (head_dim + 2)


def test_parse_accepts_cli_and_enum_names_and_rejects_others():
    for p in KVProfile:
        assert KVProfile.parse(p.value) is p
        assert KVProfile.parse(p.name) is p
        assert KVProfile.parse(p.value.upper()) is p
        assert KVProfile.parse(p) is p
    for bad in ("fp16", "int4", "", None, 3):
        with pytest.raises(ValueError, match="allowed: bf16, int8-g64, fp8-e4m3fn-row256, nvfp4-g16, k8v4"):
            KVProfile.parse(bad)


def test_codec_rejects_unknown_tensor():
    with pytest.raises(ValueError, match="'q'"):
        KVProfile.BF16.codec("q")


@given(profile=st.sampled_from(list(KVProfile)), groups=st.integers(1, 64))
def test_bytes_are_the_sum_of_typed_planes(profile, groups):
    head_dim = 64 * groups
    planes = profile.planes(head_dim)
    assert profile.token_head_bytes(head_dim) == sum(p.extent * p.dtype.itemsize for p in planes)
    assert profile.token_head_bytes(head_dim) == profile.tensor_bytes("k", head_dim) + profile.tensor_bytes("v", head_dim)
    for p in planes:
        # Every element of D is covered exactly once by codes, and every group by exactly one scale.
        if p.role == "data":
            assert p.extent * p.codec.pack == head_dim
        else:
            assert p.extent * p.group == head_dim
