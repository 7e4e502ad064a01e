"""PagedKVStorageLayout: a profile's plane schema expanded per layer into a typed plane inventory.

The layout is the single description of a pool's buffers: the device planes are allocated from
it (:func:`ninfer_kv.ops.views.allocate_planes`, the same shapes and dtypes), and every byte count
(``page_bytes``, ``buffer_bytes``, ``memory_summary``, the capacity curve of
:mod:`ninfer_kv.planning`, Host extents) is read from the same inventory.
"""

from __future__ import annotations

import dataclasses
import math


import numpy as np

from .geometry import PAGE_SIZE, KVPageGeometry, PlaneOrder
from .integers import check_int
from .profiles import KVProfile, PlaneSpec

__all__ = ["PlaneInventoryEntry", "PlaneMemory", "PoolMemorySummary", "PagedKVStorageLayout", "word_dtype"]

_UINT_OF_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def word_dtype(dtype) -> np.dtype:
    """The unsigned word dtype of ``dtype``'s width (pages move as raw bits, byte-exactly)."""
    return _UINT_OF_SIZE[np.dtype(dtype).itemsize]


@dataclasses.dataclass(frozen=True)
class PlaneInventoryEntry:
    """One (layer, plane) of a pool with its plane ordinal.

    Ordinals run layer-major: layer 0's planes in schema order, then layer 1's, and so on.
    ``bytes_per_token`` covers all KV heads of that layer plane.

    Attributes:
      ordinal: position in the inventory, ``layer * len(planes) + schema index``.
      layer: the layer, in ``[0, num_layers)``.
      plane: the :class:`~ninfer_kv.schema.profiles.PlaneSpec` of the plane.
      bytes_per_token: bytes of one token of this layer plane over all ``H`` KV heads,
        ``plane.token_head_bytes * H``.
    """

    ordinal: int
    layer: int
    plane: PlaneSpec
    bytes_per_token: int

    @property
    def name(self) -> str:
        """The plane key: ``"k"``, ``"k_scale"``, ``"v"`` or ``"v_scale"``."""
        return self.plane.name


@dataclasses.dataclass(frozen=True)
class PlaneMemory:
    """Memory of one plane kind across all layers of a pool.

    Attributes:
      name: the plane key (``"k"``, ``"k_scale"``, ``"v"``, ``"v_scale"``).
      dtype: the storage dtype's numpy name (``"bfloat16"``, ``"int8"``, ``"float8_e4m3fn"``,
        ``"uint8"``).
      shape: the stacked plane's shape at ``num_pages`` pages, ``(num_layers, N, H, P, X)``
        (page-major) or ``(num_layers, H, N, P, X)`` (head-major).
      bytes: bytes of the whole stacked plane at ``num_pages`` pages.
      bytes_per_token: bytes of one token over every layer and KV head of this plane.
      page_bytes: bytes of one page (64 tokens) over every layer and KV head of this plane.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    bytes_per_token: int
    page_bytes: int

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict (``shape`` as a list)."""
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class PoolMemorySummary:
    """Bytes of a pool at ``num_pages`` physical pages, per plane and in total.

    Built by :meth:`PagedKVStorageLayout.memory_summary`.

    Attributes:
      pool: the pool's name as given (``"main"`` by default).
      profile: the profile's name (``"k8v4"``, ...).
      order: the plane order's name (``"page-major"`` or ``"head-major"``).
      num_pages: physical pages ``N``.
      planes: one :class:`PlaneMemory` per plane, in schema order.
    """

    pool: str
    profile: str
    order: str
    num_pages: int
    planes: tuple[PlaneMemory, ...]

    @property
    def bytes(self) -> int:
        """Bytes of every plane of the pool at ``num_pages`` pages (what ``allocate`` creates)."""
        return sum(p.bytes for p in self.planes)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over every plane, layer and KV head."""
        return sum(p.bytes_per_token for p in self.planes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (64 tokens) over every plane, layer and KV head (PageBytes)."""
        return sum(p.page_bytes for p in self.planes)

    def to_json(self) -> dict:
        """A JSON-ready dict: the fields, the three byte totals and ``planes`` as a list of dicts."""
        return {
            "pool": self.pool,
            "profile": self.profile,
            "order": self.order,
            "num_pages": self.num_pages,
            "bytes": self.bytes,
            "bytes_per_token": self.bytes_per_token,
            "page_bytes": self.page_bytes,
            "planes": [p.to_json() for p in self.planes],
        }


def _positive_int(name: str, value) -> int:
    return check_int(name, value, 1)


class PagedKVStorageLayout:
    """Typed plane layout of one growing pool.

    Args:
      profile: a :class:`KVProfile` or its CLI name.
      num_layers: layers whose planes this pool stacks.
      num_kv_heads: KV heads H.
      head_dim: head dim D (checked against the profile).
      order: ``"page-major"`` (Main, MTP) or ``"head-major"`` (Draft Full).
      page_size: must be 64.

    Attributes:
      profile: the parsed :class:`KVProfile`.
      num_layers: layers stacked on the leading axis of every plane.
      geometry: the :class:`~ninfer_kv.schema.geometry.KVPageGeometry` (``H``, ``D``, order, ``P``).
      planes: the profile's :class:`~ninfer_kv.schema.profiles.PlaneSpec` tuple for ``head_dim``, in
        schema order (``k``, [``k_scale``], ``v``, [``v_scale``]).
      inventory: one :class:`PlaneInventoryEntry` per (layer, plane), layer-major.

    Raises:
      ValueError: an unknown profile or order, a count that is not an integer >= 1, a
        ``page_size`` other than 64, or a head dim the profile cannot store.

    ``allocate(num_pages)`` returns the device planes keyed ``k``, ``v`` and, where the profile has
    them, ``k_scale`` and ``v_scale``; each has shape ``(num_layers, N, H, P, X)`` (page-major) or
    ``(num_layers, H, N, P, X)`` (head-major).
    """

    def __init__(
        self,
        profile: "KVProfile | str",
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        order: "PlaneOrder | str" = "page-major",
        page_size: int = PAGE_SIZE,
    ):
        self.profile = KVProfile.parse(profile)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.geometry = KVPageGeometry(
            num_kv_heads=_positive_int("num_kv_heads", num_kv_heads),
            head_dim=_positive_int("head_dim", head_dim),
            order=PlaneOrder.parse(order),
            page_size=page_size,
        )
        self.planes: tuple[PlaneSpec, ...] = self.profile.planes(self.head_dim)
        inventory = []
        for layer in range(self.num_layers):
            for spec in self.planes:
                inventory.append(
                    PlaneInventoryEntry(
                        ordinal=len(inventory),
                        layer=layer,
                        plane=spec,
                        bytes_per_token=spec.token_head_bytes * self.num_kv_heads,
                    )
                )
        self.inventory: tuple[PlaneInventoryEntry, ...] = tuple(inventory)

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def order(self) -> PlaneOrder:
        """The plane order: page-major ``(num_layers, N, H, P, X)`` or head-major ``(num_layers, H, N, P, X)``."""
        return self.geometry.order

    @property
    def num_kv_heads(self) -> int:
        """KV heads ``H`` of every plane."""
        return self.geometry.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Head dim ``D`` (the unquantized K/V vector length)."""
        return self.geometry.head_dim

    @property
    def page_size(self) -> int:
        """Tokens per page ``P`` (always 64)."""
        return self.geometry.page_size

    @property
    def plane_names(self) -> tuple[str, ...]:
        """The plane keys in schema order, e.g. ``("k", "k_scale", "v", "v_scale")``."""
        return tuple(p.name for p in self.planes)

    def plane(self, name: str) -> PlaneSpec:
        """The :class:`~ninfer_kv.schema.profiles.PlaneSpec` of plane ``name``.

        Raises:
          KeyError: the profile has no plane ``name`` (the message lists its planes).
        """
        for p in self.planes:
            if p.name == name:
                return p
        raise KeyError(f"profile {self.profile.value} has no plane {name!r}; planes: {', '.join(self.plane_names)}")

    # -- bytes --------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token across every layer, head and plane of the pool."""
        return sum(e.bytes_per_token for e in self.inventory)

    @property
    def page_bytes(self) -> int:
        """PageBytes = sum over the inventory of plane bytes per token * P."""
        return sum(e.bytes_per_token * self.page_size for e in self.inventory)

    def plane_page_bytes(self, name: str) -> int:
        """Bytes of one page in plane ``name`` across all layers."""
        return sum(e.bytes_per_token * self.page_size for e in self.inventory if e.name == name)

    # -- buffers ------------------------------------------------------------------------------------
    def plane_shape(self, name: str, num_pages: int) -> tuple[int, ...]:
        """Numpy shape of stacked plane ``name`` at ``num_pages`` physical pages.

        ``(num_layers, num_pages, H, 64, X)`` page-major or ``(num_layers, H, num_pages, 64, X)``
        head-major, ``X`` the plane's extent.  ``num_pages`` is not checked here.

        Raises:
          KeyError: an unknown plane name.
        """
        spec = self.plane(name)
        return self.order.stacked_shape(self.num_layers, num_pages, self.num_kv_heads, self.page_size, spec.extent)

    def plane_shapes(self, num_pages: int) -> dict[str, tuple[int, ...]]:
        """:meth:`plane_shape` of every plane at ``num_pages`` pages, keyed by plane name."""
        return {p.name: self.plane_shape(p.name, num_pages) for p in self.planes}

    def plane_dtypes(self) -> dict[str, np.dtype]:
        """The numpy storage dtype of every plane, keyed by plane name (bf16 and e4m3fn as ``ml_dtypes``)."""
        return {p.name: p.dtype for p in self.planes}

    def buffer_bytes(self, num_pages: int) -> int:
        """Bytes of the buffers ``allocate(num_pages)`` creates (from the same shapes)."""
        _positive_int("num_pages", num_pages)
        return sum(math.prod(self.plane_shape(p.name, num_pages)) * p.dtype.itemsize for p in self.planes)

    def memory_summary(self, num_pages: int, pool: str = "main") -> PoolMemorySummary:
        """Per-plane bytes of the pool at ``num_pages`` pages, derived from the inventory."""
        num_pages = _positive_int("num_pages", num_pages)
        planes = []
        for p in self.planes:
            entries = [e for e in self.inventory if e.name == p.name]
            per_token = sum(e.bytes_per_token for e in entries)
            planes.append(
                PlaneMemory(
                    name=p.name,
                    dtype=p.dtype_name,
                    shape=self.plane_shape(p.name, num_pages),
                    bytes=per_token * self.page_size * num_pages,
                    bytes_per_token=per_token,
                    page_bytes=per_token * self.page_size,
                )
            )
        return PoolMemorySummary(
            pool=pool, profile=self.profile.value, order=self.order.value, num_pages=num_pages, planes=tuple(planes)
        )

    def __repr__(self) -> str:
        return (
            f"PagedKVStorageLayout(profile={self.profile.value!r}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, order={self.order.value!r}, "
            f"page_size={self.page_size})"
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, PagedKVStorageLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self):
        return (self.profile, self.num_layers, self.num_kv_heads, self.head_dim, self.order, self.page_size)
