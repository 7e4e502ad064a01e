"""The safetensors reader against hand-built bytes, and its refusals: integers checked before any
arithmetic, tensors read into fresh arrays, random corruption loaded or refused, nothing else."""

from __future__ import annotations

import dataclasses
import json
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_kv.models.hf import CheckpointError, SafetensorsError, read_header, read_tensors, write_safetensors
from ninfer_kv.models.hf.safetensors_io import tensor


def _file(path, header: dict, data: bytes, pad: int = 0):
    raw = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_reads_hand_built_bytes(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16)
    data = a.tobytes() + b.tobytes()
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "BF16", "shape": [3], "data_offsets": [24, 30]}, "__metadata__": {"format": "pt"}}
    path = _file(tmp_path / "x.safetensors", header, data, pad=3)
    h = read_header(path)
    assert h.metadata == {"format": "pt"} and set(h.tensors) == {"a", "b"}
    np.testing.assert_array_equal(tensor(h.tensors["a"]), a)
    got = tensor(h.tensors["b"])
    assert got.dtype == ml_dtypes.bfloat16 and not isinstance(got, np.memmap) and got.flags.owndata  # a fresh copy
    np.testing.assert_array_equal(got.astype(np.float32), [1.5, -2.0, 3.25])


def test_write_then_read_round_trips_every_float_dtype(tmp_path):
    tensors = {f"t{i}": np.linspace(-3, 3, 10).astype(dt).reshape(2, 5)
               for i, dt in enumerate((ml_dtypes.bfloat16, np.float16, np.float32, np.int32))}
    write_safetensors(tmp_path / "y.safetensors", tensors)
    h = read_header(tmp_path / "y.safetensors")
    assert min(t.begin for t in h.tensors.values()) % 8 == 0  # the data starts 8-byte aligned
    for name, a in tensors.items():
        np.testing.assert_array_equal(tensor(h.tensors[name]), a)


@pytest.mark.parametrize("header, data, match", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, r"'a'.*ends at byte .* truncated"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, r"'a'.*hold 12 bytes.*needs 16"),
    ({"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, r"'a': dtype 'Q4'"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, r"'a' and 'b' overlap"),
], ids=["truncated", "length", "dtype", "overlap"])
def test_refusals_name_the_tensor(tmp_path, header, data, match):
    with pytest.raises(SafetensorsError, match=match):
        read_header(_file(tmp_path / "bad.safetensors", header, data))


def test_refuses_what_is_not_safetensors(tmp_path):
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(SafetensorsError, match="too short"):
        read_header(tmp_path / "short")
    (tmp_path / "big").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(SafetensorsError, match="header length 1000000"):
        read_header(tmp_path / "big")
    (tmp_path / "json").write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        read_header(tmp_path / "json")


# -- integers, ranks and types: exact arithmetic, nothing wraps ----------------------------------------


@pytest.mark.parametrize("entry, match", [
    ({"dtype": "F32", "shape": [2**64], "data_offsets": [0, 0]},
     r"'a': shape \[18446744073709551616\] has dimension 18446744073709551616; each must be an integer in "
     r"\[0, 4611686018427387904\]"),
    ({"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]},
     r"'a': shape \[4294967296, 4294967296\] has 18446744073709551616 elements .* at most 4611686018427387904"),
    ({"dtype": "BF16", "shape": [2**62, 4], "data_offsets": [0, 0]}, r"'a': shape \[4611686018427387904, 4\] has "),
    ({"dtype": "BF16", "shape": [2**31, 2**31], "data_offsets": [0, 0]}, r"'a': data_offsets \[0, 0\] hold 0 bytes; "
                                                                          r"dtype BF16 shape .* needs 9223372036854775808"),
    ({"dtype": "F32", "shape": [1] * 17, "data_offsets": [0, 4]}, r"'a': shape .* must be a list of at most 16 integers"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}, r"'a': shape \[-1\] has dimension -1"),
    ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, r"'a': shape \[1\.0\] has dimension 1\.0"),
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, r"'a': dtype \['F32'\] is not supported"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 2**64 + 4]}, r"'a': data_offsets .* hold 18446744073709551620 bytes"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [2**64, 2**64 + 4]}, r"'a': its data ends at byte \d+ but the file has \d+ bytes \(the file is truncated\)"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, r"'a': data_offsets \[4, 0\] must satisfy 0 <= begin <= end"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, True]}, r"'a': data_offsets \[0, True\] must be \[begin, end\]"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}, r"'a': entry must have exactly dtype, shape"),
], ids=["dim-2**64", "2**32x2**32-in-0-bytes", "2**62x4-in-0-bytes", "2**31x2**31-bytes", "rank-17", "negative", "float-dim",
        "dtype-list", "offset-2**64", "begin-2**64", "reversed", "bool-offset", "extra-key"])
def test_header_integers_are_checked_before_any_arithmetic(tmp_path, entry, match):
    path = _file(tmp_path / "x.safetensors", {"a": entry}, b"\0" * 8)
    with pytest.raises(SafetensorsError, match=match) as info:
        read_header(path)
    assert "x.safetensors" in str(info.value)


def test_header_limit_is_the_formats_own(tmp_path):
    from ninfer_kv.models.hf.safetensors_io import MAX_HEADER_BYTES

    assert MAX_HEADER_BYTES == 100_000_000 and issubclass(SafetensorsError, CheckpointError)
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(8 + MAX_HEADER_BYTES + 1)  # sparse: the header is refused by its length alone
    with pytest.raises(SafetensorsError, match=r"big\.safetensors: header length 100000001 is over the format's limit"):
        read_header(path)


def test_read_tensors_refuses_a_file_changed_or_cut_after_its_header(tmp_path):
    write_safetensors(tmp_path / "y.safetensors", {"a": np.arange(64, dtype=np.float32), "b": np.ones(64, np.float32)})
    h = read_header(tmp_path / "y.safetensors")
    infos = sorted(h.tensors.values(), key=lambda t: t.begin)
    with open(tmp_path / "y.safetensors", "r+b") as f:
        f.truncate(infos[1].begin + 8)
    with pytest.raises(SafetensorsError, match=r"y\.safetensors: tensor 'a': the file changed after its header was read"):
        list(read_tensors(tmp_path / "y.safetensors", infos))
    unchecked = [dataclasses.replace(t, file_identity=None) for t in infos]
    with pytest.raises(SafetensorsError, match=r"y\.safetensors: tensor 'b': the file ended at byte \d+, inside the "
                                               r"tensor's bytes"):
        list(read_tensors(tmp_path / "y.safetensors", unchecked))


# -- random corruption: a correct load or a SafetensorsError, nothing else -----------------------------



_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.sampled_from([0, 1, 2, 4, 8, 2**31, 2**32, 2**62, 2**63, 2**64])
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
            | st.sampled_from(["BF16", "F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "Q4"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
_GOOD = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
         "b": {"dtype": "BF16", "shape": [3], "data_offsets": [24, 30]}}
_DATA = np.arange(6, dtype=np.float32).tobytes() + np.ones(3, np.dtype("uint16")).tobytes()


def _read_all(path) -> None:
    h = read_header(path)
    for info, arr in read_tensors(path, h.tensors.values()):
        assert arr.shape == info.shape and arr.nbytes == info.nbytes


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("corrupt") / "x.safetensors"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["a", "b"]), st.sampled_from(["dtype", "shape", "data_offsets", None]), _VALUES)
def test_random_header_values_load_or_are_refused(scratch, tensor_name, field, value):
    header = json.loads(json.dumps(_GOOD))
    if field is None:
        header[tensor_name] = value
    else:
        header[tensor_name][field] = value
    _file(scratch, header, _DATA)
    try:
        _read_all(scratch)
    except SafetensorsError as exc:
        assert "x.safetensors" in str(exc)


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("valid") / "v.safetensors"
    write_safetensors(path, {"w": np.linspace(-1, 1, 12).astype(ml_dtypes.bfloat16).reshape(3, 4),
                             "n": np.ones(5, np.float32), "e": np.zeros((0, 7), np.float16)}, {"format": "pt"})
    return path.read_bytes()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_byte_flips_and_truncations_load_or_are_refused(scratch, valid_bytes, data):
    raw = bytearray(valid_bytes)
    for _ in range(data.draw(st.integers(0, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    scratch.write_bytes(bytes(raw))
    try:
        _read_all(scratch)
    except SafetensorsError as exc:
        assert "x.safetensors" in str(exc)
