"""The safetensors file format: the header validated, tensors read into fresh numpy arrays, and written.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON, then the tensor
bytes.  The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the end of the header; C order, little-endian) and may hold a
``"__metadata__"`` dict of strings.

:func:`read_header` opens the file once (a regular file only, never blocking:
:class:`~ninfer_kv.models.hf.bounded_files.RegularFile`), refuses a header longer than the format's
own limit (:data:`MAX_HEADER_BYTES`) or nested deeper than
:data:`~ninfer_kv.models.hf.bounded_files.MAX_JSON_DEPTH`, and validates the whole table against the
file size with exact integer arithmetic before any tensor byte is read: every dtype known, at most
:data:`MAX_RANK` dimensions, each dimension and the element count at most :data:`MAX_ELEMENTS`,
every tensor's byte range inside the file and of length ``prod(shape) * itemsize``, no two ranges
overlapping.  A problem is a :class:`SafetensorsError` (a
:class:`~ninfer_kv.models.hf.config.CheckpointError`) naming the file and the tensor.

:func:`read_tensors` reads many tensors of one file through one descriptor into fresh arrays
(``np.empty`` filled by ``preadv``); nothing is memory-mapped, so no array read here aliases the
file, and the file may be rewritten, truncated or deleted afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from .bounded_files import RegularFile, parse_json
from .config import CheckpointError

__all__ = [
    "SafetensorsError",
    "TensorInfo",
    "SafetensorsHeader",
    "read_header",
    "read_tensors",
    "tensor",
    "write_safetensors",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_RANK",
    "MAX_ELEMENTS",
]

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

MAX_HEADER_BYTES = 100_000_000
"""The format's own limit on the JSON header (the ``safetensors`` library refuses longer ones)."""

MAX_RANK = 16
"""Most dimensions of a tensor (published checkpoints use at most 5)."""

MAX_ELEMENTS = 2**62
"""Largest dimension and largest element count (zero dimensions counted as 1): int64 arithmetic on
shapes, numpy's included, can never wrap."""

_NAMES = {dt: name for name, dt in DTYPES.items()}
_FIELDS = {"dtype", "shape", "data_offsets"}


class SafetensorsError(CheckpointError):
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
      file_identity: the file's ``(st_dev, st_ino, st_size, st_mtime_ns)`` when its header was read
        (:func:`read_tensors` refuses a file that changed since), or ``None``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    path: Path
    file_identity: tuple[int, int, int, int] | None = None

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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(value, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate the header of ``path`` (see the module docstring); reads no tensor data."""
    path = Path(path)
    try:
        return _read_header(path)
    except SafetensorsError:
        raise
    except CheckpointError as exc:  # opening, UTF-8 and JSON refusals of the shared readers
        raise SafetensorsError(str(exc)) from None


def _read_header(path: Path) -> SafetensorsHeader:
    with RegularFile(path) as f:
        size = f.size
        head = f.read_at(0, 8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(
                f"{path}: header length {n} is over the format's limit of {MAX_HEADER_BYTES} bytes (not safetensors)"
            )
        if 8 + n > size:
            raise SafetensorsError(
                f"{path}: header length {n} does not fit the file of {size} bytes (truncated or not safetensors)"
            )
        raw = f.read_at(8, n)
        identity = f.identity
    if len(raw) < n:
        raise SafetensorsError(f"{path}: the file ended at byte {8 + len(raw)} inside its {n}-byte header (truncated)")
    table = parse_json(raw, f"{path} (header)")
    if not isinstance(table, dict):
        raise SafetensorsError(f"{path}: the header must be a JSON object, got {type(table).__name__}")
    metadata = table.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of strings, got {_show(metadata)}")
    base = 8 + n
    room = size - base
    tensors: dict[str, TensorInfo] = {}
    for name, entry in table.items():
        tensors[name] = _entry(path, name, entry, base, room, identity)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {_show(n0, 200)} and {_show(n1, 200)} overlap (bytes {b1}..{e0})")
    return SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()}, size)


def _entry(path: Path, name: str, entry, base: int, room: int, identity: tuple) -> TensorInfo:
    """One header entry validated with Python integers (no wrapping) against the ``room`` bytes of data."""
    if not isinstance(entry, dict) or len(entry) != 3 or entry.keys() != _FIELDS:
        raise _bad(path, name, f"entry must have exactly dtype, shape and data_offsets, got {_show(entry)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(path, name, f"dtype {_show(dtype)} is not supported; allowed: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise _bad(path, name, f"shape {_show(shape)} must be a list of at most {MAX_RANK} integers")
    for d in shape:
        if not _is_int(d) or not 0 <= d <= MAX_ELEMENTS:
            raise _bad(path, name, f"shape {_show(shape)} has dimension {_show(d, 40)}; each must be an integer in "
                                   f"[0, {MAX_ELEMENTS}]")
    count = math.prod(shape)
    if count > MAX_ELEMENTS or (count == 0 and math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS):
        span = math.prod(max(d, 1) for d in shape)
        raise _bad(path, name, f"shape {_show(shape)} has {span} elements (zero dimensions counted as 1); at most "
                               f"{MAX_ELEMENTS} are allowed")
    if not isinstance(offsets, list) or len(offsets) != 2 or not (_is_int(offsets[0]) and _is_int(offsets[1])):
        raise _bad(path, name, f"data_offsets {_show(offsets)} must be [begin, end], two integers")
    lo, hi = offsets
    if not 0 <= lo <= hi:
        raise _bad(path, name, f"data_offsets {_show(offsets)} must satisfy 0 <= begin <= end")
    want = count * DTYPES[dtype].itemsize
    if hi - lo != want:
        raise _bad(path, name, f"data_offsets {_show(offsets)} hold {hi - lo} bytes; dtype {dtype} shape {_show(shape)} "
                               f"needs {want}")
    if hi > room:
        raise _bad(path, name, f"its data ends at byte {base + hi} but the file has {base + room} bytes (the file is "
                               f"truncated)")
    return TensorInfo(name, dtype, tuple(shape), base + lo, base + hi, path, identity)


def _bad(path: Path, name: str, what: str) -> SafetensorsError:
    return SafetensorsError(f"{path}: tensor {_show(name, 200)}: {what}")


def read_tensors(path: str | os.PathLike, infos: Iterable[TensorInfo]) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """``(info, array)`` for each of ``infos`` (tensors of the file ``path``), in file order, through one
    descriptor that is closed when the iteration ends (or is abandoned).

    Each array is fresh process memory (``np.empty`` filled by ``preadv``): it never aliases the file.
    A file that changed since its header was read, or ends before a tensor does, is a
    :class:`SafetensorsError` naming the file and the tensor.
    """
    path = Path(path)
    infos = sorted(infos, key=lambda t: t.begin)
    try:
        f = RegularFile(path)
    except CheckpointError as exc:
        raise SafetensorsError(str(exc)) from None
    with f:
        for info in infos:
            where = f"{path}: tensor {_show(info.name, 200)}"
            if info.file_identity is not None and f.identity != info.file_identity:
                raise SafetensorsError(f"{where}: the file changed after its header was read "
                                       f"(size {info.file_identity[2]} then, {f.size} now); load it again")
            try:
                out = np.empty(info.shape, info.numpy_dtype)
            except MemoryError:
                raise SafetensorsError(f"{where}: {info.nbytes} bytes cannot be allocated in host memory") from None
            try:
                got = f.read_into(out, info.begin) if info.nbytes else 0
            except CheckpointError as exc:
                raise SafetensorsError(f"{exc}; {where}") from None
            if got != info.nbytes:
                raise SafetensorsError(f"{where}: the file ended at byte {info.begin + got}, inside "
                                       f"the tensor's bytes {info.begin}..{info.end} (truncated while read)")
            yield info, out


def tensor(info: TensorInfo) -> np.ndarray:
    """``info``'s data as a fresh array (the file is opened, read and closed; nothing stays mapped)."""
    reader = read_tensors(info.path, [info])
    try:
        return next(reader)[1]
    finally:
        reader.close()


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
