"""Byte sizes: read the sizes people type (``40GiB``, ``1e9``) and print exact counts readably.

One syntax everywhere: the command line's byte flags (``--free-bytes``, ``--host-bytes``, ...) and
the Python arguments that take a byte count (``AutomaticCapacity(free_bytes=, headroom_bytes=)``,
planning's ``fixed_bytes``, ``KVStore(host_bytes=)``, ``HostKVArena(capacity_bytes)``) accept

* an integer (Python or numpy): ``1073741824``;
* a float holding a whole number of bytes: ``4e10``;
* a string: a plain integer, scientific notation (``1e9``) or a number with a suffix ``KB``/``MB``/
  ``GB``/``TB`` (powers of 1000; also ``K``/``M``/``G``/``T``) or ``KiB``/``MiB``/``GiB``/``TiB``
  (powers of 1024), case ignored: ``"40GiB"``, ``"512 MiB"``, ``"1.5GB"``.

Every byte count a table or an error message prints goes through :func:`describe_bytes`
(``'34,361,835,520 B (32.00 GiB)'``) or, where the exact count is shown beside it already,
:func:`format_bytes` (``'32.00 GiB'``).

This module imports nothing from the package, so anything may use it.
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Union

__all__ = [
    "ByteSize",
    "ByteSizeTypeError",
    "BYTE_SIZE_FORMS",
    "INT64_MAX",
    "parse_bytes",
    "to_byte_count",
    "byte_count",
    "byte_range",
    "format_bytes",
    "describe_bytes",
]

INT64_MAX = 2**63 - 1
"""Largest byte count: every byte count of the package fits int64."""

ByteSize = Union[int, float, str]
"""What a byte-count argument accepts: an integer, a whole-number float or a byte-size string."""

BYTE_SIZE_FORMS = (
    "plain integers, scientific notation (1e9) and the suffixes KB/MB/GB/TB (powers of 1000) and "
    "KiB/MiB/GiB/TiB (powers of 1024), e.g. 40GiB or 512MiB"
)
"""The accepted string forms in words (for help texts)."""

_ACCEPTED_TYPES = "an integer, a float holding a whole number of bytes, or a byte-size string such as '40GiB'"
_MAX_DIGITS = 60
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class ByteSizeTypeError(TypeError, ValueError):
    """A byte-count argument of a type that is not accepted (a bool, a list, ``None``, ...).

    A ``TypeError``; also a ``ValueError``, so code that reports every bad planning argument by
    catching ``ValueError`` (the command line does) reports this one too.
    """


def _parse(text: str, subject: str) -> int:
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{subject} is invalid; use a non-negative integer, scientific notation (1e9) or a "
            "number with a suffix KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 40GiB"
        )
    number = match.group(1)
    mantissa, _, exponent = number.lower().partition("e")
    if len(mantissa) > _MAX_DIGITS or len(exponent) > 4 or abs(int(exponent or 0)) > _MAX_DIGITS:
        raise ValueError(f"{subject} is too large; it must be at most {INT64_MAX} bytes (int64)")
    value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"{subject} is {float(value)} bytes; it must be a whole number of bytes")
    if value > INT64_MAX:
        raise ValueError(f"{subject} is {int(value)} bytes; it must be at most {INT64_MAX} bytes (int64)")
    return int(value)


def parse_bytes(text: str) -> int:
    """Parse a byte size: ``1073741824``, ``1e9``, ``40GiB``, ``512MiB``, ``1.5GB``.

    Decimal suffixes (``KB``, ``MB``, ``GB``, ``TB``; also ``K``/``M``/``G``/``T``) are powers of
    1000, binary suffixes (``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024; case is ignored.  The
    result must be a whole, non-negative number of bytes that fits int64.

    Raises:
      ValueError: naming the text and the accepted forms.
    """
    return _parse(str(text), f"byte size {text!r}")


def to_byte_count(value: object, name: str = "bytes") -> int:
    """``value`` as an exact ``int`` number of bytes (see the module docstring for the forms).

    No range is checked for integers and floats (a negative integer comes back negative; use
    :func:`byte_count` for a bounded count); a string is always a count in ``[0, INT64_MAX]``.

    Raises:
      ByteSizeTypeError: ``value`` is a bool or of a type that is not accepted (message names ``name``
        and the accepted types).
      ValueError: a float that is not a whole number (or not finite), or a string that is not a byte
        size (message names ``name``, the value and the accepted forms).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ByteSizeTypeError(f"{name}={value!r} ({type(value).__name__}) is not a byte count; use {_ACCEPTED_TYPES}")
    if isinstance(value, str):
        return _parse(value, f"{name}={value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    exact = Fraction(value) if isinstance(value, numbers.Rational) else float(value)
    if (isinstance(exact, float) and not math.isfinite(exact)) or exact != int(exact):
        raise ValueError(f"{name}={value!r} is not a whole number of bytes; use {_ACCEPTED_TYPES}")
    return int(exact)


def byte_count(value: object, name: str = "bytes", *, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """:func:`to_byte_count`, then check ``minimum <= count <= maximum``.

    Raises:
      ByteSizeTypeError: as :func:`to_byte_count`.
      ValueError: as :func:`to_byte_count`, or the count is outside the range (message names
        ``name``, the value and the range).
    """
    count = to_byte_count(value, name)
    if not minimum <= count <= maximum:
        shown = f"{value!r}" + (f" ({format_bytes(count)})" if count >= 1024 and not isinstance(value, str) else "")
        raise ValueError(f"{name}={shown} is out of range; it must be {byte_range(minimum, maximum)}")
    return count


def byte_range(minimum: int, maximum: int) -> str:
    """The range ``[minimum, maximum]`` of a byte count in words, for error messages."""
    return f"a byte count in [{describe_bytes(minimum)}, {describe_bytes(maximum)}]"


def format_bytes(n: int) -> str:
    """Human-readable binary units: ``823296`` -> ``'804.0 KiB'``, ``512`` -> ``'512 B'``."""
    n = int(n)
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024.0
        if abs(value) < 1024.0 or unit == "EiB":
            return f"{value:.2f} {unit}" if abs(value) < 100 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def describe_bytes(n: int) -> str:
    """The exact count with the binary-unit form beside it from 1 KiB up.

    ``34361835520`` -> ``'34,361,835,520 B (32.00 GiB)'``; ``512`` -> ``'512 B'``.
    """
    n = int(n)
    return f"{n:,} B" + (f" ({format_bytes(n)})" if abs(n) >= 1024 else "")
