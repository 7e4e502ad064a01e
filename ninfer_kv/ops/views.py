"""Consumer views: JAX pytrees over a pool's stacked planes.

Arrays are leaves; the layout (profile, order, page size, head dim, KV heads) is static metadata,
so a view is a valid argument of a ``jax.jit`` function and its graph key never depends on page
IDs, table contents or the layer index (a Python int layer becomes a traced scalar under jit).

* :class:`PagedKVBatchLayerView` — the pool's stacked planes, the block-table matrix
  ``int32 (C, L)`` and a layer index; ``table_rows int32 (B,)`` is a separate op input.
* :class:`PagedKVLayerView` — one sequence: the stacked planes, one block-table row ``int32 (L,)``
  and a layer index.
* :class:`CyclicKVCacheLayerView` — per-row ring buffers (DFlash local window), no page IDs.

A view holds no allocator handle, request identity, reservation, ownership or frontier.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ..schema.layout import PagedKVStorageLayout
from ..schema.profiles import KVProfile

__all__ = [
    "allocate_planes",
    "PagedKVLayerView",
    "PagedKVBatchLayerView",
    "CyclicKVCacheLayerView",
    "CyclicKVLayout",
    "LayerIndex",
    "ring_table",
]

LayerIndex = Union[int, jax.Array]
"""A layer index: a Python int or a (possibly traced) integer scalar array."""


def ring_table(block_tables: jax.Array, pages_per_row: int) -> jax.Array:
    """The block table of window rings (:mod:`ninfer_kv.planning.rings`) from Main's ``int32 (C, L)``.

    Entry ``(r, b)`` is ring page ``r * pages_per_row + b mod pages_per_row`` wherever Main's entry
    ``(r, b)`` maps a page (``>= 0``), and Main's entry (the sentinel) where it does not: a ring is
    written and read exactly where Main's bookkeeping lets a row write and read.  Computed inside a
    step (``C * L`` integer operations, once per step); ``pages_per_row`` is static.
    """
    k = int(pages_per_row)
    c, length = block_tables.shape
    rows = jnp.arange(c, dtype=jnp.int32)[:, None] * jnp.int32(k)
    ring = rows + jnp.arange(length, dtype=jnp.int32)[None, :] % jnp.int32(k)
    return jnp.where(block_tables >= 0, ring, block_tables)


def allocate_planes(layout: PagedKVStorageLayout, num_pages: int, *, device=None, fill=None) -> dict[str, jax.Array]:
    """Allocate the planes of ``layout`` for ``num_pages`` physical pages.

    Args:
      layout: a :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout`.
      num_pages: physical page count N of the pool.
      device: optional ``jax.Device`` or sharding to place the planes on.
      fill: optional fill value (default zeros).  A NaN fill is applied to float planes only
        (integer planes stay zero); any other value fills every plane, cast to its dtype.

    Returns:
      ``{plane name: array}`` with the shapes of ``layout.plane_shape`` and the dtypes of
      ``layout.plane_dtypes``.

    Raises:
      ValueError: ``num_pages`` is not an integer >= 1.
      TypeError: ``layout`` is not a :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout`.
    """
    if not isinstance(layout, PagedKVStorageLayout):
        raise TypeError(f"layout must be a PagedKVStorageLayout, got {type(layout).__name__}")
    layout.buffer_bytes(num_pages)  # validates num_pages (an integer >= 1)
    out = {}
    for p in layout.planes:
        value = 0
        if fill is not None and (jnp.issubdtype(p.dtype, jnp.floating) or not np.isnan(fill)):
            value = fill
        arr = jnp.full(layout.plane_shape(p.name, num_pages), value, dtype=p.dtype)
        out[p.name] = jax.device_put(arr, device) if device is not None else arr
    return out


def _check_planes(planes: dict, expected_shapes: dict, dtypes: dict, what: str) -> None:
    if set(planes) != set(expected_shapes):
        raise ValueError(f"{what}: planes keyed {sorted(planes)}; the layout needs exactly {sorted(expected_shapes)}")
    for name, arr in planes.items():
        if not hasattr(arr, "shape"):
            raise TypeError(f"{what}: plane {name!r} is {type(arr).__name__}, expected an array")
        want_shape = expected_shapes[name]
        if tuple(arr.shape) != tuple(want_shape):
            raise ValueError(f"{what}: plane {name!r} has shape {tuple(arr.shape)}, expected {tuple(want_shape)}")
        if np.dtype(arr.dtype) != np.dtype(dtypes[name]):
            raise ValueError(f"{what}: plane {name!r} has dtype {np.dtype(arr.dtype).name}, expected {dtypes[name].name}")


def _num_pages(planes: dict, layout: PagedKVStorageLayout) -> int:
    k = planes.get("k")
    if k is None or not hasattr(k, "shape"):
        raise ValueError(f"planes must contain a 'k' array; got keys {sorted(planes)}")
    if len(k.shape) != 5:
        raise ValueError(f"plane 'k' must be stacked with a layer axis (5-D), got shape {tuple(k.shape)}")
    return int(k.shape[layout.order.page_axis])


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_layer(layer: ArrayLike, num_layers: int) -> None:
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= int(layer) < num_layers:
            raise ValueError(f"layer={int(layer)} is out of range [0, {num_layers})")
        return
    if hasattr(layer, "shape") and hasattr(layer, "dtype"):
        if tuple(layer.shape) != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise ValueError(f"layer must be an int or an int32 scalar array, got shape {tuple(layer.shape)} {layer.dtype}")
        if _is_concrete(layer):
            v = int(np.asarray(layer))
            if not 0 <= v < num_layers:
                raise ValueError(f"layer={v} is out of range [0, {num_layers})")
        return
    raise TypeError(f"layer must be a Python int or an int32 scalar array, got {type(layer).__name__}")


class _LayerViewBase:
    """Behaviour shared by the view pytrees.

    A subclass is a frozen dataclass whose fields are its array leaves (``_LEAVES``, in order),
    then ``layout`` (static, an instance of ``_LAYOUT_TYPE``), then the ``validate`` init flag.
    Flattening yields the leaves as children and the layout as aux data; unflattening skips
    validation (leaves may be tracers or placeholders there).
    """

    _LEAVES: tuple[str, ...] = ()
    _LAYOUT_TYPE: type = object

    def __post_init__(self, validate: bool):
        if not isinstance(self.layout, self._LAYOUT_TYPE):
            raise TypeError(f"layout must be a {self._LAYOUT_TYPE.__name__}, got {type(self.layout).__name__}")
        if validate:
            self.check()

    def _expected_plane_shapes(self) -> dict:
        return self.layout.plane_shapes()

    def _check_tables(self) -> None:
        """Validate the block-table leaf, if the view has one."""

    def check(self) -> None:
        """Check plane keys, shapes, dtypes, the block table (paged views) and the layer, on the host."""
        lay = self.layout
        _check_planes(self.planes, self._expected_plane_shapes(), lay.plane_dtypes(), type(self).__name__)
        self._check_tables()
        _check_layer(self.layer, lay.num_layers)

    def _replaced(self, **changes):
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(changes)
        return type(self)(**fields)

    def tree_flatten(self):
        """Pytree protocol: ``(leaves in _LEAVES order, layout)``; the layout is the static aux data."""
        return tuple(getattr(self, name) for name in self._LEAVES), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        """Pytree protocol: rebuild a view from ``layout`` and its leaves, without validation."""
        return cls(*children, layout, validate=False)


class _PagedViewBase(_LayerViewBase):
    """Validation shared by the paged views: the page count is read off the stacked ``k`` plane."""

    _LAYOUT_TYPE = PagedKVStorageLayout

    def _expected_plane_shapes(self) -> dict:
        return self.layout.plane_shapes(_num_pages(self.planes, self.layout))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PagedKVBatchLayerView(_PagedViewBase):
    """Batched view of one layer of a pool: stacked planes + block tables ``int32 (C, L)`` + layer.

    Args:
      planes: the dict returned by ``allocate_planes(layout, num_pages)`` (or the planes a step received).
      block_tables: ``int32 (C, L)``; entry ``[r, b]`` is the physical page of logical block ``b`` of
        the address space leased execution row ``r``.
      layer: a Python int or a (traced) int32 scalar selecting the layer in the stacked planes.
      layout: the pool's :class:`PagedKVStorageLayout` (static).
      validate: run :meth:`check` at construction (default True; pytree unflattening skips it).

    Raises:
      ValueError: plane keys, shapes or dtypes that do not match ``layout``, a block table that is
        not ``int32 (C, L)``, a layer array that is not an integer scalar, or a concrete layer
        outside ``[0, num_layers)``.
      TypeError: ``layout`` is not a :class:`PagedKVStorageLayout`, a plane is not an array, or
        ``layer`` is neither an int nor an array.
    """

    planes: dict[str, jax.Array]
    block_tables: jax.Array
    layer: LayerIndex
    layout: PagedKVStorageLayout
    validate: dataclasses.InitVar[bool] = True

    _LEAVES = ("planes", "block_tables", "layer")

    def _check_tables(self) -> None:
        bt = self.block_tables
        if not hasattr(bt, "shape") or len(bt.shape) != 2:
            raise ValueError(f"block_tables must be int32 (C, L), got shape {getattr(bt, 'shape', None)}")
        if np.dtype(bt.dtype) != np.int32:
            raise ValueError(f"block_tables must be int32, got {np.dtype(bt.dtype).name}")

    @property
    def num_pages(self) -> int:
        """Physical pages ``N`` of the pool, read off the page axis of the stacked ``k`` plane."""
        return _num_pages(self.planes, self.layout)

    @property
    def max_concurrency(self) -> int:
        """Block-table rows ``C`` (execution rows), ``block_tables.shape[0]``."""
        return int(self.block_tables.shape[0])

    @property
    def logical_pages(self) -> int:
        """Logical pages per row ``L = ceil(S / 64)``, ``block_tables.shape[1]``."""
        return int(self.block_tables.shape[1])

    @property
    def profile(self) -> KVProfile:
        """The pool's :class:`~ninfer_kv.schema.profiles.KVProfile` (from the layout)."""
        return self.layout.profile

    @property
    def num_kv_heads(self) -> int:
        """KV heads ``H`` of the planes (from the layout)."""
        return self.layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Head dim ``D`` (from the layout)."""
        return self.layout.head_dim

    @property
    def page_size(self) -> int:
        """Tokens per page ``P`` (64)."""
        return self.layout.page_size

    def replace(self, **changes) -> "PagedKVBatchLayerView":
        """A copy with some fields replaced (e.g. ``planes`` returned by an append)."""
        return self._replaced(**changes)

    def with_layer(self, layer: LayerIndex) -> "PagedKVBatchLayerView":
        """A copy reading layer ``layer`` (a Python int or an int32 scalar, traced or not)."""
        return self.replace(layer=layer)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PagedKVLayerView(_PagedViewBase):
    """Single-sequence view: stacked planes + one block-table row ``int32 (L,)`` + layer index.

    Args:
      planes: the pool's stacked planes, as for :class:`PagedKVBatchLayerView`.
      block_table: ``int32 (L,)``; entry ``b`` is the physical page of logical block ``b``.
      layer: a Python int or a (traced) int32 scalar.
      layout: the pool's :class:`PagedKVStorageLayout` (static).
      validate: run :meth:`check` at construction (default True).

    The ops accept it in place of a batch view with ``table_rows=None`` (every batch row reads this
    one table row).  Raises as :class:`PagedKVBatchLayerView`, for a block table that is not
    ``int32 (L,)``.
    """

    planes: dict[str, jax.Array]
    block_table: jax.Array
    layer: LayerIndex
    layout: PagedKVStorageLayout
    validate: dataclasses.InitVar[bool] = True

    _LEAVES = ("planes", "block_table", "layer")

    def _check_tables(self) -> None:
        bt = self.block_table
        if not hasattr(bt, "shape") or len(bt.shape) != 1 or np.dtype(bt.dtype) != np.int32:
            raise ValueError(
                f"block_table must be int32 (L,), got shape {getattr(bt, 'shape', None)} "
                f"dtype {getattr(bt, 'dtype', None)}"
            )

    def as_batch(self) -> PagedKVBatchLayerView:
        """The equivalent batch view with one table row (use ``table_rows = zeros((B,), int32)``)."""
        return PagedKVBatchLayerView(self.planes, self.block_table[None, :], self.layer, self.layout, validate=False)


@dataclasses.dataclass(frozen=True)
class CyclicKVLayout:
    """Static layout of per-row cyclic K/V state (DFlash local window).

    Each plane is ``(num_layers, rows, H, slots, X)``.  ``window`` W is the attention window (key j is
    visible to the query at position p iff ``p - W < j <= p``); ``slots`` (default W) is the ring
    size, slot ``j mod slots``.  A chunk of T queries needs ``slots >= window + T - 1`` so that
    appending the chunk does not evict keys its first query still sees.

    Attributes:
      profile: the :class:`KVProfile` of the ring planes (a name is parsed).
      num_layers: layers stacked on the leading axis.
      rows: ring buffers (one per execution row).
      num_kv_heads: KV heads ``H``.
      head_dim: head dim ``D`` (checked against the profile).
      window: attention window ``W`` in tokens.
      slots: ring size in tokens (default ``window``; at least ``window``).

    Raises:
      ValueError: a count that is not an integer >= 1, ``slots < window``, an unknown profile or a
        head dim the profile cannot store.
    """

    profile: KVProfile
    num_layers: int
    rows: int
    num_kv_heads: int
    head_dim: int
    window: int
    slots: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        for name in ("num_layers", "rows", "num_kv_heads", "head_dim", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; it must be an integer >= 1")
        if self.slots is None:
            object.__setattr__(self, "slots", self.window)
        if not isinstance(self.slots, int) or self.slots < self.window:
            raise ValueError(f"slots={self.slots!r} is invalid; it must be an integer >= window={self.window}")
        self.profile.check_head_dim(self.head_dim)

    @property
    def planes(self) -> tuple:
        """The profile's :class:`~ninfer_kv.schema.profiles.PlaneSpec` entries for ``head_dim``."""
        return self.profile.planes(self.head_dim)

    def plane_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every plane, ``(num_layers, rows, H, slots, X)``, keyed by plane name."""
        return {p.name: (self.num_layers, self.rows, self.num_kv_heads, self.slots, p.extent) for p in self.planes}

    def plane_dtypes(self) -> dict[str, np.dtype]:
        """The numpy storage dtype of every plane, keyed by plane name."""
        return {p.name: p.dtype for p in self.planes}

    def allocate(self, *, fill: float | None = None) -> dict[str, jax.Array]:
        """Zeroed planes (or planes filled with ``fill``; NaN fills float planes only)."""
        out = {}
        for p in self.planes:
            value = 0
            if fill is not None and (jnp.issubdtype(p.dtype, jnp.floating) or not np.isnan(fill)):
                value = fill
            out[p.name] = jnp.full(self.plane_shapes()[p.name], value, dtype=p.dtype)
        return out


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class CyclicKVCacheLayerView(_LayerViewBase):
    """Per-row ring buffers of one layer: planes ``(num_layers, rows, H, slots, X)`` + layer index.

    Args:
      planes: the dict returned by ``layout.allocate()`` (or the planes a step received).
      layer: a Python int or a (traced) int32 scalar selecting the layer.
      layout: the :class:`CyclicKVLayout` (static).
      validate: run :meth:`check` at construction (default True).

    Raises:
      ValueError: plane keys, shapes or dtypes that do not match ``layout``, a layer array that is
        not an integer scalar, or a concrete layer outside ``[0, num_layers)``.
      TypeError: ``layout`` is not a :class:`CyclicKVLayout`, a plane is not an array, or ``layer``
        is neither an int nor an array.
    """

    planes: dict[str, jax.Array]
    layer: LayerIndex
    layout: CyclicKVLayout
    validate: dataclasses.InitVar[bool] = True

    _LEAVES = ("planes", "layer")
    _LAYOUT_TYPE = CyclicKVLayout

    def replace(self, **changes) -> "CyclicKVCacheLayerView":
        """A copy with some fields replaced (e.g. ``planes`` returned by an append)."""
        return self._replaced(**changes)
