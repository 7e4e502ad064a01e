"""HostKVPageLayout: the packed, logical-order byte layout of a pool's pages in a Host extent.

A Host extent of ``n`` pages is ``n * stride`` bytes: page ``i`` of the extent is logical page ``i``
of whatever the extent replicates (no Device page IDs, no block-table holes).  One Host page holds
every grouped plane payload of the pool for that page, packed without gaps, **plane-major**::

    page i = [ plane k     : layer 0 (H, P, X) | layer 1 (H, P, X) | ... | layer L-1 (H, P, X) ]
             [ plane k_scale: layer 0 ...                                                      ]
             [ plane v      : ...                                                              ]
             [ plane v_scale: ...                                                              ]

Planes follow the profile's schema order (``k``, [``k_scale``], ``v``, [``v_scale``]); each
``(H, P, X)`` block is C-ordered elements of the plane's storage dtype, byte-identical to the
Device page.  Page-major and head-major pools share this Host layout (a head-major page is
transposed to ``(H, P, X)`` per layer on the way).  The full page is always copied, including
columns beyond a partial tail's committed frontier: the payload of a page is the whole page.

``stride`` (bytes of one Host page) is derived from the segments and must equal
``PagedKVStorageLayout.page_bytes``, the inventory's PageBytes; a Main extent and a speculative pool's extent
with different strides live side by side in one :class:`~ninfer_kv.host.arena.HostKVArena`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..schema.layout import PagedKVStorageLayout

__all__ = ["HostKVPageLayout", "HostPageSegment", "TransferReport", "host_layout_of"]


@dataclasses.dataclass(frozen=True)
class HostPageSegment:
    """One (plane, layer) block of a Host page: ``nbytes`` at byte ``offset`` within the page,
    holding ``shape = (H, P, X)`` elements of ``dtype``."""

    plane: str
    layer: int
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, int, int]


class HostKVPageLayout:
    """Packed logical-order Host page layout of one pool (see the module docstring).

    Args:
      layout: the pool's :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout`.

    Attributes:
      layout: the pool's layout.
      segments: one :class:`HostPageSegment` per (plane, layer), plane-major, in byte order.
      stride: bytes of one Host page (equal to ``layout.page_bytes``).

    Raises:
      TypeError: ``layout`` is not a :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout`.
    """

    def __init__(self, layout: PagedKVStorageLayout):
        if not isinstance(layout, PagedKVStorageLayout):
            raise TypeError(f"layout must be a PagedKVStorageLayout, got {type(layout).__name__}")
        self.layout = layout
        h, p = layout.num_kv_heads, layout.page_size
        segments = []
        plane_offsets = {}
        offset = 0
        for spec in layout.planes:
            plane_offsets[spec.name] = offset
            for layer in range(layout.num_layers):
                nbytes = h * p * spec.extent * spec.dtype.itemsize
                segments.append(HostPageSegment(spec.name, layer, offset, nbytes, spec.dtype, (h, p, spec.extent)))
                offset += nbytes
        self.segments: tuple[HostPageSegment, ...] = tuple(segments)
        self._plane_offsets = plane_offsets
        self.stride = offset
        if self.stride != layout.page_bytes:
            raise AssertionError(
                f"host page stride {self.stride} differs from the layout's PageBytes {layout.page_bytes} for {layout!r}"
            )

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def plane_names(self) -> tuple[str, ...]:
        """The plane keys in schema order (the order of the planes within a Host page)."""
        return self.layout.plane_names

    @property
    def num_layers(self) -> int:
        """Layers of the pool (segments per plane)."""
        return self.layout.num_layers

    def plane_offset(self, name: str) -> int:
        """Byte offset of plane ``name``'s block (all layers) within one Host page."""
        self.layout.plane(name)  # raises KeyError naming the allowed planes
        return self._plane_offsets[name]

    def plane_block_bytes(self, name: str) -> int:
        """Bytes of plane ``name`` (all layers) within one Host page."""
        return self.layout.plane_page_bytes(name)

    def segment(self, plane: str, layer: int) -> HostPageSegment:
        """The :class:`HostPageSegment` of ``(plane, layer)``: its byte offset, size, dtype and ``(H, P, X)`` shape.

        Raises:
          ValueError: ``layer`` outside ``[0, num_layers)``.
          KeyError: an unknown plane (the message lists the planes).
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range [0, {self.num_layers})")
        self.layout.plane(plane)  # raises KeyError naming the allowed planes
        return self.segments[self.layout.plane_names.index(plane) * self.num_layers + layer]

    def extent_bytes(self, num_pages: int) -> int:
        """Exact packed bytes of an extent holding ``num_pages`` pages: ``num_pages * stride``."""
        if not isinstance(num_pages, (int, np.integer)) or isinstance(num_pages, bool) or num_pages < 1:
            raise ValueError(f"num_pages={num_pages!r} is invalid; it must be an integer >= 1")
        return int(num_pages) * self.stride

    def pages_in(self, nbytes: int) -> int:
        """Pages of an extent of ``nbytes`` payload bytes; it must be a whole multiple of the stride."""
        if nbytes % self.stride:
            raise ValueError(
                f"an extent of {nbytes} bytes does not hold whole pages of this layout "
                f"(stride {self.stride} bytes); it was sized for a different pool layout"
            )
        return nbytes // self.stride

    # -- numpy packing (the byte definition of the layout) ----------------------------------------
    def page_planes(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Zero-copy views of a packed buffer of ``n`` pages: plane -> ``(n, L, H, P, X)``.

        ``buf`` is a 1-D uint8 array of ``n * stride`` bytes (e.g. ``arena.view(extent)``).  Writing
        through the views writes the buffer.
        """
        buf = self._check_buffer(buf)
        n = buf.size // self.stride
        rows = buf.reshape(n, self.stride)
        lay = self.layout
        out = {}
        for spec in lay.planes:
            off = self._plane_offsets[spec.name]
            block = rows[:, off : off + lay.plane_page_bytes(spec.name)]
            out[spec.name] = block.view(spec.dtype).reshape(
                n, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent
            )
        return out

    def pack(self, planes: dict, out: np.ndarray) -> None:
        """Pack stacked numpy planes of ``n`` pages (``n`` on the page axis, logical order) into ``out``."""
        views = self.page_planes(out)
        n = next(iter(views.values())).shape[0]
        axis = self.layout.order.page_axis
        for name, view in views.items():
            src = np.asarray(planes[name])
            want = self.layout.plane_shape(name, n)
            if src.shape != want or src.dtype != view.dtype:
                raise ValueError(
                    f"plane {name!r}: got {src.shape} {src.dtype}, expected {want} {view.dtype} for {n} pages"
                )
            view[...] = np.moveaxis(src, axis, 0)

    def unpack(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Stacked numpy planes (Device plane order, ``n`` pages on the page axis) of a packed buffer."""
        axis = self.layout.order.page_axis
        return {name: np.ascontiguousarray(np.moveaxis(v, 0, axis)) for name, v in self.page_planes(buf).items()}

    def _check_buffer(self, buf) -> np.ndarray:
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
            raise ValueError(
                f"expected a 1-D uint8 numpy buffer, got {type(buf).__name__} "
                f"{getattr(buf, 'dtype', None)} {getattr(buf, 'shape', None)}"
            )
        if buf.size == 0 or buf.size % self.stride:
            raise ValueError(f"buffer of {buf.size} bytes is not a positive multiple of the page stride {self.stride}")
        return buf

    # -- identity -------------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return isinstance(other, HostKVPageLayout) and self.layout == other.layout

    def __hash__(self) -> int:
        return hash(("HostKVPageLayout", self.layout))

    def __repr__(self) -> str:
        return f"HostKVPageLayout({self.layout!r}, stride={self.stride})"


@dataclasses.dataclass(frozen=True)
class TransferReport:
    """What one offload or restore moved.

    ``runs``: runs of adjacent physical IDs (the contract's transfer runs); ``chunks``: copies
    issued (``>= runs``: power-of-two pieces of runs for the jitted copies); ``pages`` and ``bytes``:
    payload moved; ``path``: ``"packed"`` or ``"host"``.
    """

    pages: int
    runs: int
    chunks: int
    bytes: int
    path: str


@functools.lru_cache(maxsize=64)
def host_layout_of(layout: PagedKVStorageLayout) -> HostKVPageLayout:
    """The (cached) :class:`HostKVPageLayout` of a pool layout."""
    return HostKVPageLayout(layout)


# -- word views -----------------------------------------------------------------------------------
