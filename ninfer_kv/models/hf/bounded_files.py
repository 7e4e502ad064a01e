"""Bounded reading of checkpoint files: regular files only, sizes capped, strict UTF-8, JSON nesting capped.

Every file of a checkpoint directory is opened with ``O_RDONLY | O_NONBLOCK`` (opening a FIFO or a
device never waits for a writer), checked with ``fstat`` to be a regular file, and read through that
one descriptor, which is closed when its ``with`` block ends.  A JSON file is read whole but never
more than its cap plus one byte, decoded as strict UTF-8 (no byte-order mark, as JSON requires), and
its nesting depth is measured in time linear in the text, without recursion, before ``json.loads``
sees it.

The caps:

* ``config.json`` and ``generation_config.json``: :data:`MAX_CONFIG_BYTES` (4 MiB);
* ``model.safetensors.index.json``: :data:`MAX_INDEX_BYTES` (64 MiB);
* ``tokenizer.json``: :data:`MAX_TOKENIZER_BYTES` (256 MiB);
* a safetensors header: ``safetensors_io.MAX_HEADER_BYTES`` (100 000 000 bytes, the format's own);

and JSON nesting (arrays and objects) is at most :data:`MAX_JSON_DEPTH` levels deep.  A refusal is a
:class:`~ninfer_kv.models.hf.config.CheckpointError` naming the file and what is allowed.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from .config import CheckpointError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_TOKENIZER_BYTES",
    "MAX_JSON_DEPTH",
    "RegularFile",
    "read_bounded",
    "decode_utf8",
    "check_json_depth",
    "parse_json",
    "load_json",
]

MAX_CONFIG_BYTES = 4 * 2**20
"""Largest ``config.json`` or ``generation_config.json`` (published ones are a few KiB)."""

MAX_INDEX_BYTES = 64 * 2**20
"""Largest ``model.safetensors.index.json`` (about 600 000 tensor names; the largest published are ~10 MB)."""

MAX_TOKENIZER_BYTES = 256 * 2**20
"""Largest ``tokenizer.json`` (published ones are up to ~35 MB)."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in any JSON file of a checkpoint (published files use <= 8)."""

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 22  # bytes per step of the depth scan
_MAX_READ = 1 << 30  # bytes per pread/preadv call (Linux returns at most ~2 GiB per call anyway)


class RegularFile:
    """A regular file opened read-only without blocking; use it in a ``with`` block (closed on exit).

    Attributes:
      path: the file.
      fd: its descriptor.
      size: its size in bytes when opened.
      identity: ``(st_dev, st_ino, st_size, st_mtime_ns)`` when opened, to tell a later open of the
        same path whether the file changed in between.
    Raises:
      CheckpointError: the file cannot be opened, or is not a regular file (a FIFO, a directory, a device).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, _OPEN_FLAGS)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot be opened ({exc.strerror or exc})") from None
        except ValueError as exc:  # a NUL byte, or a name the file system encoding cannot hold
            raise CheckpointError(f"{str(self.path)!r}: cannot be opened ({exc})") from None
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            os.close(self.fd)
            raise CheckpointError(f"{self.path}: cannot be examined ({exc.strerror or exc})") from None
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise CheckpointError(f"{self.path}: is not a regular file ({_kind(st.st_mode)}); a checkpoint holds regular files")
        self.size = st.st_size
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def __enter__(self) -> "RegularFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes from ``offset`` (fewer only at the end of the file)."""
        parts = []
        while n > 0:
            try:
                part = os.pread(self.fd, min(n, _MAX_READ), offset)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot be read ({exc.strerror or exc})") from None
            if not part:
                break
            parts.append(part)
            offset += len(part)
            n -= len(part)
        return b"".join(parts)

    def read_into(self, out: np.ndarray, offset: int) -> int:
        """Fill the C-contiguous array ``out`` with the bytes from ``offset``; returns the bytes read
        (fewer than ``out.nbytes`` only at the end of the file)."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self.fd, [view[done : done + _MAX_READ]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot be read ({exc.strerror or exc})") from None
            if got == 0:
                break
            done += got
        return done


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The whole of the regular file ``path``, refused when it holds more than ``limit`` bytes.

    At most ``limit + 1`` bytes are read, so a file growing while it is read is refused too.
    """
    with RegularFile(path) as f:
        if f.size > limit:
            raise CheckpointError(f"{f.path}: {f.size} bytes is too large; the limit for this file is {limit} bytes")
        data = f.read_at(0, limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{f.path}: more than {limit} bytes (it grew while read); the limit for this file is {limit} bytes")
    return data


def decode_utf8(raw: bytes, path: str | os.PathLike) -> str:
    """``raw`` decoded as strict UTF-8; a byte-order mark or an invalid byte is refused naming ``path`` and the offset."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raise CheckpointError(f"{path}: starts with a UTF-8 byte-order mark (bytes 0..2); JSON text must not have one")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not valid UTF-8 at byte {exc.start} ({exc.reason}); the file must be UTF-8 text") from None


def check_json_depth(raw: bytes, path: str | os.PathLike, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON text whose arrays and objects nest deeper than ``limit``, before it is parsed.

    Linear time, no recursion, no per-character Python: escaped backslashes and quotes are blanked
    (``bytes.replace``), then in steps of 4 MiB numpy finds the brackets outside string literals
    (an even number of quotes before them) and a cumulative sum of +1 per ``[``/``{`` and -1 per
    ``]``/``}`` gives the depth.  The result is exact on every prefix that is valid JSON, which is all
    a parser descends through before it stops at an error.
    """
    text = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    parity = 0  # quotes seen so far, mod 2: 1 inside a string literal
    depth = 0
    for start in range(0, len(text), _CHUNK):
        c = np.frombuffer(text, np.uint8, count=min(_CHUNK, len(text) - start), offset=start)
        opens = (c == 0x5B) | (c == 0x7B)
        brackets = np.flatnonzero(opens | (c == 0x5D) | (c == 0x7D))
        quotes = np.flatnonzero(c == 0x22)
        if brackets.size:
            outside = brackets[((np.searchsorted(quotes, brackets) + parity) & 1) == 0]
            if outside.size:
                levels = np.cumsum(np.where(opens[outside], 1, -1), dtype=np.int64) + depth
                deep = levels > limit
                if deep.any():
                    at = start + int(outside[int(np.argmax(deep))])
                    raise CheckpointError(
                        f"{path}: JSON nested deeper than {limit} levels (at byte {at}); at most {limit} levels are allowed"
                    )
                depth = int(levels[-1])
        parity = (parity + quotes.size) & 1


def parse_json(raw: bytes, path: str | os.PathLike) -> Any:
    """``raw`` decoded (:func:`decode_utf8`), depth-checked (:func:`check_json_depth`) and parsed.

    Integers longer than Python's digit limit (4300), and any syntax error, are refused naming ``path``.
    """
    text = decode_utf8(raw, path)
    check_json_depth(raw, path)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, over-long integers
        raise CheckpointError(f"{path}: not valid JSON ({_short(str(exc), 200)})") from None


def load_json(path: str | os.PathLike, limit: int) -> Any:
    """The parsed JSON of the regular file ``path`` of at most ``limit`` bytes (see the module docstring)."""
    return parse_json(read_bounded(path, limit), path)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
