"""Page geometry and the two closed plane orders.

Shapes are written in numpy order (outermost first).  One layer's plane is

* page-major ``(N, H, P, X)`` (Main Text, MTP);
* head-major ``(H, N, P, X)`` (Draft Full).

A pool stacks all its layers on a leading axis: ``(num_layers, N, H, P, X)`` or
``(num_layers, H, N, P, X)``.  Address translation with ``P = 64``::

    block = pos >> 6;  offset = pos & 63;  page = table[row, block]
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["PAGE_SIZE", "SENTINEL_PAGE", "PlaneOrder", "KVPageGeometry", "ceil_div"]

PAGE_SIZE = 64
"""The fixed token page size P of every growing pool."""

SENTINEL_PAGE = -1
"""The block-table entry of a logical block that maps no page (outside ``[0, N)`` of every pool)."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for Python ints, exactly (no float rounding); ``b > 0``."""
    return -(-a // b)


class PlaneOrder(enum.Enum):
    """The closed plane orders (numpy order of one layer's plane)."""

    PAGE_MAJOR = "page-major"  # (N, H, P, X)
    HEAD_MAJOR = "head-major"  # (H, N, P, X)

    @classmethod
    def parse(cls, order: "str | PlaneOrder") -> "PlaneOrder":
        """Resolve ``"page-major"`` / ``"head-major"`` (case ignored, ``_`` read as ``-``) or a member.

        Raises:
          ValueError: any other value, naming it and the allowed names.
        """
        if isinstance(order, PlaneOrder):
            return order
        if isinstance(order, str):
            key = order.strip().lower().replace("_", "-")
            for member in cls:
                if key == member.value:
                    return member
        raise ValueError(f"unknown plane order {order!r}; allowed: page-major, head-major")

    def layer_shape(self, num_pages: int, num_heads: int, page_size: int, extent: int) -> tuple[int, ...]:
        """Numpy shape of one layer's plane."""
        if self is PlaneOrder.PAGE_MAJOR:
            return (num_pages, num_heads, page_size, extent)
        return (num_heads, num_pages, page_size, extent)

    def stacked_shape(
        self, num_layers: int, num_pages: int, num_heads: int, page_size: int, extent: int
    ) -> tuple[int, ...]:
        """Numpy shape of a pool's plane with the leading layer axis."""
        return (num_layers,) + self.layer_shape(num_pages, num_heads, page_size, extent)

    @property
    def page_axis(self) -> int:
        """Axis of the physical page ID in a *stacked* plane (layer axis first)."""
        return 1 if self is PlaneOrder.PAGE_MAJOR else 2

    @property
    def head_axis(self) -> int:
        """Axis of the KV head in a *stacked* plane (layer axis first)."""
        return 2 if self is PlaneOrder.PAGE_MAJOR else 1


@dataclasses.dataclass(frozen=True)
class KVPageGeometry:
    """Geometry of the pages of one pool: page size (fixed 64), KV heads, head dim and plane order.

    Attributes:
      num_kv_heads: KV heads ``H`` (an integer >= 1).
      head_dim: head dim ``D`` (an integer >= 1).
      order: the :class:`PlaneOrder` (a name is parsed).
      page_size: tokens per page ``P``; must be 64.

    Raises:
      ValueError: ``page_size != 64``, a head count or head dim that is not an integer >= 1, or an
        unknown order.
    """

    num_kv_heads: int
    head_dim: int
    order: PlaneOrder = PlaneOrder.PAGE_MAJOR
    page_size: int = PAGE_SIZE

    def __post_init__(self):
        if self.page_size != PAGE_SIZE:
            raise ValueError(f"page_size={self.page_size} is not supported; every growing pool uses P={PAGE_SIZE}")
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= 1")
        object.__setattr__(self, "order", PlaneOrder.parse(self.order))

    def logical_pages(self, max_context: int) -> int:
        """L = ceil(S / P): logical page capacity of one address space."""
        return ceil_div(max_context, self.page_size)

    def block_of(self, position: int) -> int:
        """Logical block (page index in the block table) of token ``position``: ``position // P``."""
        return position // self.page_size

    def offset_of(self, position: int) -> int:
        """Column (token slot within its page) of token ``position``: ``position % P``."""
        return position % self.page_size
