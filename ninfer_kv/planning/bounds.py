"""Planning bounds: the limits every planned value must respect, and the one error naming them.

Every byte count is an exact Python int and must fit int64; every physical page ID of every pool
(``0 .. pages - 1``) and every token position of a sequence (``0 .. L * P - 1``, and ``kv_lens`` up
to ``L * P``) must fit the int32 block tables and position arrays; layers, KV heads and head dim
are bounded far above any real model (:data:`MAX_LAYERS`, :data:`MAX_KV_HEADS`,
:data:`MAX_HEAD_DIM`).  A value outside these bounds raises :class:`PlanBoundError` (a
``ValueError``) naming the parameter, its value and the allowed range.
"""

from __future__ import annotations

from ..schema.geometry import PAGE_SIZE
from ..schema.integers import check_int
from ..schema.layout import PagedKVStorageLayout
from ..schema.sizes import INT64_MAX, byte_range, describe_bytes, format_bytes, to_byte_count

__all__ = [
    "TABLE_ENTRY_BYTES", "INT32_MAX", "MAX_PAGES", "MAX_CONTEXT", "MAX_LAYERS", "MAX_KV_HEADS",
    "MAX_HEAD_DIM", "PlanBoundError", "check_pool_bytes",
]

TABLE_ENTRY_BYTES = 4  # int32 block-table entries


INT32_MAX = 2**31 - 1


MAX_PAGES = INT32_MAX + 1
"""Most physical pages one pool may hold: page IDs ``0 .. MAX_PAGES - 1`` fit int32."""


MAX_CONTEXT = (INT32_MAX // PAGE_SIZE) * PAGE_SIZE
"""Largest ``S``: the positions ``0 .. L * P - 1`` and ``kv_lens <= L * P`` fit int32."""


MAX_LAYERS = 4096
"""Most layers one pool stacks (its plane inventory has one entry per layer and plane)."""


MAX_KV_HEADS = 65536
"""Most KV heads."""


MAX_HEAD_DIM = 65536
"""Largest head dim."""


class PlanBoundError(ValueError):
    """A planning value outside its allowed range.

    Attributes:
      name: the parameter (``max_context``, ``draft_window``, ...).
      value: the value given.
      allowed: the allowed range in words (``"an integer in [1, 8192]"``).
      why: the reason for the bound, or ``""``.
      shown: the value as printed after ``name=`` (default ``repr(value)``; byte counts add the
        binary-unit form).
    """

    def __init__(self, name: str, value: object, allowed: str, why: str = "", *, shown: str | None = None):
        self.name, self.value, self.allowed, self.why = name, value, allowed, why
        shown = repr(value) if shown is None else shown
        super().__init__(f"{name}={shown} is out of range; it must be {allowed}" + (f" ({why})" if why else ""))


def _int_at_least(name: str, value: object, minimum: int, maximum: int | None = None, why: str = "") -> int:
    """:func:`~ninfer_kv.schema.integers.check_int` raising :class:`PlanBoundError` (with ``why``)."""
    return check_int(name, value, minimum, maximum, error=lambda n, v, allowed: PlanBoundError(n, v, allowed, why))


def _shown_bytes(value: object) -> str:
    """``repr(value)``, with the binary-unit form beside an integer byte count of 1 KiB or more."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        return f"{value!r} ({format_bytes(value)})"
    return repr(value)


def _byte_count(name: str, value: object) -> int:
    """A byte-count argument (integer, whole float or byte-size string) as an int in ``[0, INT64_MAX]``."""
    count = to_byte_count(value, name)
    if not 0 <= count <= INT64_MAX:
        shown = repr(value) + (f" ({format_bytes(count)})" if count >= 1024 else "")
        raise PlanBoundError(name, value, byte_range(0, INT64_MAX), "byte counts are int64", shown=shown)
    return count


def _check_bytes(name: str, value: int, what: str) -> int:
    if value > INT64_MAX:
        raise PlanBoundError(
            name, value, f"at most {INT64_MAX} bytes", f"{what} must fit int64", shown=_shown_bytes(value)
        )
    return value


def check_pool_bytes(layout: PagedKVStorageLayout, num_pages: int) -> int:
    """Check one pool of ``num_pages`` pages: int32 page IDs, int64 bytes; returns its bytes."""
    _int_at_least("num_pages", num_pages, 1, MAX_PAGES, "page IDs are int32")
    total = layout.buffer_bytes(num_pages)
    if layout.page_bytes > INT64_MAX:
        raise PlanBoundError(
            "page_bytes", layout.page_bytes, f"at most {INT64_MAX} bytes",
            "one page of layers x KV heads x head dim must fit int64; the geometry cannot be real",
            shown=_shown_bytes(layout.page_bytes),
        )
    if total > INT64_MAX:
        raise PlanBoundError(
            "num_pages", num_pages, f"an integer in [1, {INT64_MAX // layout.page_bytes}]",
            f"the pool's bytes, {describe_bytes(layout.page_bytes)} per page, must fit int64",
        )
    return total
