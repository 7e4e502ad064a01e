"""Integer arguments: one check for every integer a caller passes (a leaf module: numpy only).

An integer argument is a Python ``int`` or a numpy integer, never a ``bool``, within an inclusive
range ``[minimum, maximum]`` (no upper bound when ``maximum`` is ``None``).  :func:`check_int`
returns it as an ``int``, or raises an error naming the argument, the value and the allowed range
in words (:func:`int_range`)::

    check_int("head_dim", 0, 1)   # ValueError: head_dim=0 is invalid; it must be an integer >= 1

A caller with its own error type passes ``error``: a callable ``(name, value, allowed)`` returning
the exception to raise (``value`` as given when it is no integer, as an ``int`` when it is out of
range).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["check_int", "int_range", "is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python or numpy integer (a ``bool`` is not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def int_range(minimum: int, maximum: int | None = None) -> str:
    """The allowed range in words: ``"an integer >= 1"`` or ``"an integer in [1, 8]"``."""
    return f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"


def _invalid(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid; it must be {allowed}")


def check_int(
    name: str,
    value: object,
    minimum: int,
    maximum: int | None = None,
    *,
    error: Callable[[str, object, str], Exception] | None = None,
) -> int:
    """``value`` as an ``int`` if it is an integer in ``[minimum, maximum]``, else ``error(...)``.

    Args:
      name: the argument's name, as the message shows it (``name=value``).
      value: the value given.
      minimum, maximum: the inclusive range (``maximum=None``: no upper bound).
      error: ``(name, value, allowed) -> Exception``; default a ``ValueError``
        ``"{name}={value!r} is invalid; it must be {allowed}"``.
    """
    make = _invalid if error is None else error
    allowed = int_range(minimum, maximum)
    if not is_int(value):
        raise make(name, value, allowed)
    if value < minimum or (maximum is not None and value > maximum):
        raise make(name, int(value), allowed)
    return int(value)
