"""The safetensors file format, read memory-mapped with numpy (bfloat16 included) and written.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON, then the tensor
bytes.  The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the end of the header; C order, little-endian) and may hold a
``"__metadata__"`` dict of strings.

:func:`read_header` validates a whole file's table against its size before anything is mapped:
every tensor's byte range lies in the file, its length equals ``prod(shape) * itemsize``, ranges
do not overlap.  A problem is a :class:`SafetensorsError` naming the file and the tensor.
:func:`tensor` returns a read-only ``np.memmap`` view (no bytes are read until used).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsError", "TensorInfo", "SafetensorsHeader", "read_header", "tensor", "write_safetensors", "DTYPES"]

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
"""safetensors dtype names and the numpy dtypes they map to (little-endian)."""

_NAMES = {dt: name for name, dt in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as written: the message names the file and the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file.

    Attributes:
      name: the tensor's name.
      dtype: the safetensors dtype name (``"BF16"``, ``"F32"``, ...).
      shape: its shape.
      begin, end: absolute byte offsets of its data in the file.
      path: the file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    path: Path

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the data."""
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """The validated table of a safetensors file: ``tensors`` by name, ``metadata`` and the file size."""

    path: Path
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    file_size: int


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate the header of ``path`` (see the module docstring); reads no tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(
                    f"{path}: header length {n} does not fit the file of {size} bytes (truncated or not safetensors)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        table = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: the header is not valid JSON ({exc})") from None
    if not isinstance(table, dict):
        raise SafetensorsError(f"{path}: the header must be a JSON object, got {type(table).__name__}")
    metadata = table.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of strings")
    base = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in table.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"} or len(entry) != 3:
            raise SafetensorsError(f"{where}: entry must have exactly dtype, shape and data_offsets, got {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise SafetensorsError(f"{where}: dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        if not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise SafetensorsError(f"{where}: shape {shape!r} must be a list of integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(not isinstance(o, int) or isinstance(o, bool) or o < 0 for o in offsets) or offsets[0] > offsets[1]):
            raise SafetensorsError(f"{where}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != want:
            raise SafetensorsError(
                f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes; dtype {dtype} shape {shape} "
                f"needs {want}"
            )
        begin, end = base + offsets[0], base + offsets[1]
        if end > size:
            raise SafetensorsError(
                f"{where}: its data ends at byte {end} but the file has {size} bytes (the file is truncated)"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), begin, end, path)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {n0!r} and {n1!r} overlap (bytes {b1}..{e0})")
    return SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()}, size)


def tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped view of ``info``'s data (``np.memmap``; nothing is read until used)."""
    dt = info.numpy_dtype
    if info.nbytes == 0:
        return np.zeros(info.shape, dt)
    return np.memmap(info.path, dtype=dt, mode="r", offset=info.begin, shape=info.shape, order="C")


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (numpy arrays of a dtype in :data:`DTYPES`) to ``path`` in name order, 8-byte aligned."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = a.dtype.newbyteorder("=") if a.dtype.byteorder == ">" else a.dtype
        if np.dtype(dt) not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name; allowed: "
                                   f"{', '.join(str(d) for d in _NAMES)}")
        a = a.astype(np.dtype(dt).newbyteorder("<"), copy=False)
        header[name] = {"dtype": _NAMES[np.dtype(dt)], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    tmp = Path(str(path) + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
