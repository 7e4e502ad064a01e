"""The safetensors reader against hand-built bytes, and its refusals."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from ninfer_kv.models.hf import SafetensorsError, read_header, write_safetensors
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
    assert got.dtype == ml_dtypes.bfloat16 and isinstance(got, np.memmap)
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
