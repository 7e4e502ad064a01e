"""The one builder of poisoned paged pools and cyclic states for the kernel tests.

Everything an op must not read or write is poison:

* a paged pool: pages no row maps, columns past each row's frontier, the other layers and the table
  rows no batch row uses.  Physical pages come in a random order, batch rows go through a shuffled
  subset of the table rows, and the table entries a row does not use are junk: out-of-range IDs
  (``N``, ``N + 7``), negative ones (``-1``, ``INT32_MIN``), ``INT32_MAX`` and IDs of poisoned pages;
* a cyclic state: slots never written, the ring row no batch row uses and the other layers.

Poison ``mode="nan"``: NaN in bfloat16 / e4m3fn planes, ``0x7F`` (NaN as e4m3fn) in NVFP4 scale
planes, random bytes in int8 and packed-nibble planes.  ``mode="bytes"``: uniformly random bytes
everywhere (NaN payloads included), for appends, whose untouched bytes must come back bit for bit.
Real tokens are encoded with the numpy oracle (:mod:`.np_codecs`), never with code under test.

The default geometry of each profile (:func:`append_geometry`, :func:`attention_geometry`) rotates
plane orders and head dims over the spec table's profiles, and every test of an op uses it unless
it needs another shape, so that each (backend, op, profile) compiles once per process.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

from . import np_codecs

PAGE = 64
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
PROFILES = tuple(KVProfile)
ORDERS = tuple(PlaneOrder)


def richest_profile() -> KVProfile:
    """The profile with the most distinct plane dtypes (K8V4: both kinds of scale plane, two codecs)."""
    return max(PROFILES, key=lambda p: len({plane.dtype for plane in p.planes(64)}))


# -- default geometry ------------------------------------------------------------------------------


def _head_dim_multiple(profile: KVProfile) -> int:
    return math.lcm(profile.k_codec.spec.head_dim_multiple, profile.v_codec.spec.head_dim_multiple)


def tail_head_dim(profile: KVProfile) -> int:
    """The smallest head dim >= 36 the profile stores that is not a power of two, nor a multiple of
    8 where the codecs allow it (36, 48 or 192): a scalar tail after 8- or 16-lane CPU vectors,
    padded tiles in the Pallas kernels."""
    m = _head_dim_multiple(profile)
    d = m * -(-36 // m)
    while d & (d - 1) == 0 or (m < 8 and d % 8 == 0):
        d += m
    return d


def pow2_head_dim(profile: KVProfile) -> int:
    """The smallest power of two >= 64 the profile stores."""
    d = 64
    while d % _head_dim_multiple(profile):
        d *= 2
    return d


@dataclasses.dataclass(frozen=True)
class AppendGeometry:
    """Pool and chunk shape of a paged-append test: B batch rows of T tokens into C = B + 2 table
    rows of L logical pages over N = B * L + 4 physical pages, H KV heads, 2 layers (layer 1 used)."""

    profile: KVProfile
    order: PlaneOrder
    head_dim: int
    kv_dtype: str
    batch: int = 4
    t: int = 5
    heads: int = 2
    logical_pages: int = 3


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """Pool and query shape of a paged-attention test (``group`` query heads per KV head)."""

    profile: KVProfile
    order: PlaneOrder
    head_dim: int
    group: int
    t: int
    q_dtype: str
    sm_scale: float | None
    batch: int = 4
    heads: int = 2
    logical_pages: int = 3


def append_geometry(profile: KVProfile, order: PlaneOrder | None = None) -> AppendGeometry:
    """Profile ``i`` of the spec table: order ``i % 2``, a non-power-of-two head dim for even ``i``,
    bfloat16 K/V for ``i % 4`` in (2, 3) (float32 otherwise)."""
    i = PROFILES.index(profile)
    order = ORDERS[i % 2] if order is None else order
    d = tail_head_dim(profile) if i % 2 == 0 else pow2_head_dim(profile)
    return AppendGeometry(profile, order, d, "bfloat16" if i % 4 in (2, 3) else "float32")


# (GQA group, query length) of profile i: five profiles meet groups 1, 4, 8 and lengths 1, 3, 64.
_GROUP_T = ((4, 1), (8, 3), (1, 64), (8, 1), (4, 3))


def attention_geometry(profile: KVProfile) -> AttentionGeometry:
    """Profile ``i``: the other order than its appends, the other kind of head dim, a rotating
    (group, T), bfloat16 queries for ``i % 4`` in (1, 2) (float32 otherwise; both orders meet
    both) and an explicit ``sm_scale`` for ``i % 3 == 1``."""
    i = PROFILES.index(profile)
    group, t = _GROUP_T[i % len(_GROUP_T)]
    return AttentionGeometry(
        profile,
        ORDERS[(i + 1) % 2],
        pow2_head_dim(profile) if i % 2 == 0 else tail_head_dim(profile),
        group,
        t,
        "bfloat16" if i % 4 in (1, 2) else "float32",
        0.3 if i % 3 == 1 else None,
    )


# -- poison ----------------------------------------------------------------------------------------


def poison_planes(shapes: dict, dtypes: dict, rng, *, mode: str = "nan") -> dict[str, np.ndarray]:
    """Numpy planes full of poison (``mode`` as in the module docstring)."""
    out = {}
    for name, shape in shapes.items():
        dt = np.dtype(dtypes[name])
        raw = rng.integers(0, 256, size=tuple(shape) + (dt.itemsize,), dtype=np.uint8)
        arr = raw.view(dt).reshape(shape).copy()
        if mode == "nan":
            if dt in (np_codecs.BF16, np_codecs.E4M3):
                arr[...] = np.nan
            elif name.endswith("_scale") and dt == np.uint8:
                arr[...] = 0x7F
        elif mode != "bytes":
            raise ValueError(f"unknown poison mode {mode!r}")
        out[name] = arr
    return out


def plane_index(order: PlaneOrder, layer: int, pages, cols) -> tuple:
    """Numpy index selecting the ``(n, H, X)`` token-heads at (layer, pages[i], :, cols[i], :)."""
    if PlaneOrder(order) is PlaneOrder.PAGE_MAJOR:
        return (layer, pages, slice(None), cols, slice(None))
    return (layer, slice(None), pages, cols, slice(None))


def random_kv(rng, shape, *, dtype=np.float32, spread: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Random K and V of ``shape``; V is three times larger.  With ``spread`` every (token, head)
    row gets its own power-of-two magnitude in ``[2**-20, 2**20)``, so scales and codes cover their
    ranges."""
    x = rng.standard_normal((2,) + tuple(shape)).astype(np.float32)
    x[1] *= np.float32(3.0)
    if spread:
        x *= np.exp2(rng.integers(-20, 20, size=(2,) + tuple(shape[:-1]) + (1,))).astype(np.float32)
    x = x.astype(jnp.dtype(dtype))
    return x[0], x[1]


# -- paged pools -----------------------------------------------------------------------------------


@dataclasses.dataclass
class PagedCase:
    """A poisoned paged pool and the tokens it holds."""

    layout: PagedKVStorageLayout
    planes: dict  # plane name -> numpy array
    block_tables: np.ndarray  # int32 (C, L)
    table_rows: np.ndarray  # int32 (B,): the table row of each batch row
    layer: int
    kv_lens: np.ndarray  # int32 (B,): tokens stored for each batch row

    @property
    def num_pages(self) -> int:
        """Physical pages ``N`` of the planes."""
        return next(iter(self.planes.values())).shape[self.layout.order.page_axis]

    def view(self, planes=None, block_tables=None) -> PagedKVBatchLayerView:
        """The view of the pool (layer as an int32 array: traced under jit)."""
        planes = self.planes if planes is None else planes
        tables = self.block_tables if block_tables is None else block_tables
        return PagedKVBatchLayerView(
            {k: jnp.asarray(v) for k, v in planes.items()}, jnp.asarray(tables, jnp.int32), jnp.int32(self.layer),
            self.layout,
        )


def make_paged_case(
    profile,
    order,
    *,
    kv_lens,
    heads: int = 2,
    head_dim: int = 64,
    logical_pages: int = 3,
    extra_rows: int = 2,
    spare_pages: int = 4,
    num_layers: int = 2,
    layer: int = 1,
    seed: int = 0,
    poison: str = "nan",
    mapped_tokens=None,
) -> PagedCase:
    """A pool whose batch row ``b`` holds ``kv_lens[b]`` tokens on scattered physical pages.

    Table row ``table_rows[b]`` maps the blocks covering ``mapped_tokens[b]`` tokens (default
    ``kv_lens[b]``) to pages of their own; its other entries and the ``extra_rows`` table rows no
    batch row uses hold junk (module docstring), every kind of it in the unused rows when they have
    room.  ``N = B * logical_pages + spare_pages``.
    """
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    b = kv_lens.size
    lay = PagedKVStorageLayout(profile, num_layers, heads, head_dim, order=order)
    c, nblk = b + extra_rows, logical_pages
    n = b * nblk + spare_pages
    planes = poison_planes(lay.plane_shapes(n), lay.plane_dtypes(), rng, mode=poison)
    perm = rng.permutation(n)
    owned = perm[: b * nblk].reshape(b, nblk)  # the physical pages of each row's blocks, in random order
    junk = np.array([n, n + 7, -1, INT32_MIN, INT32_MAX, *perm[b * nblk :]], np.int64)
    tables = rng.choice(junk, size=(c, nblk))
    table_rows = rng.permutation(c)[:b].astype(np.int32)
    unused = np.setdiff1d(np.arange(c), table_rows)
    kinds = junk[: 5 + min(1, spare_pages)]  # each kind once in the unused rows when they have room
    fill = np.concatenate([kinds, rng.choice(junk, size=max(0, unused.size * nblk - kinds.size))])
    tables[unused] = rng.permutation(fill)[: unused.size * nblk].reshape(unused.size, nblk)
    tables = tables.astype(np.int32)
    mapped = kv_lens if mapped_tokens is None else np.asarray(mapped_tokens)
    for i in range(b):
        used = -(-int(mapped[i]) // PAGE)
        tables[table_rows[i], :used] = owned[i, :used]
    k, v = random_kv(rng, (b, max(1, int(kv_lens.max(initial=0))), heads, head_dim))
    token_codes = np_codecs.encode_kv(lay.profile, k, v)
    for i in range(b):
        j = np.arange(kv_lens[i])
        idx = plane_index(lay.order, layer, owned[i, j // PAGE], j % PAGE)
        for name in planes:
            planes[name][idx] = token_codes[name][i, : kv_lens[i]]
    return PagedCase(lay, planes, tables, table_rows, layer, kv_lens)


def append_case(geometry: AppendGeometry, *, seed: int = 0) -> PagedCase:
    """An empty pool of ``geometry`` (random-byte poison) whose batch rows map every block."""
    g = geometry
    full = [g.logical_pages * PAGE] * g.batch
    return make_paged_case(
        g.profile, g.order, kv_lens=[0] * g.batch, mapped_tokens=full, heads=g.heads, head_dim=g.head_dim,
        logical_pages=g.logical_pages, seed=seed, poison="bytes",
    )


def attention_case(geometry: AttentionGeometry, kv_lens, *, seed: int = 0) -> PagedCase:
    """A pool of ``geometry`` (NaN poison) whose batch row ``b`` holds ``kv_lens[b]`` tokens."""
    g = geometry
    return make_paged_case(
        g.profile, g.order, kv_lens=kv_lens, heads=g.heads, head_dim=g.head_dim, logical_pages=g.logical_pages,
        seed=seed,
    )


# -- cyclic states ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CyclicGeometry:
    """Ring shape of a cyclic test: ``rows`` ring rows (one more than the batch rows use)."""

    profile: KVProfile
    head_dim: int
    window: int
    slots: int
    rows: int = 4
    heads: int = 2


def cyclic_geometry(profile: KVProfile, op: str) -> CyclicGeometry:
    """Appends take a ring of 8 slots (chunks of 11 tokens wrap it); attention a window of 20 in
    24 slots (chunks of up to 5 queries); head dims alternate as for paged appends."""
    d = append_geometry(profile).head_dim
    return CyclicGeometry(profile, d, 5, 8) if op == "append" else CyclicGeometry(profile, d, 20, 24)


@dataclasses.dataclass
class CyclicCase:
    """A poisoned cyclic state and the tokens it holds."""

    layout: CyclicKVLayout
    planes: dict  # plane name -> numpy array
    layer: int
    written: np.ndarray  # (rows,): positions 0..written-1 were appended; slot j % slots holds the newest

    def view(self, planes=None) -> CyclicKVCacheLayerView:
        """The view of the state (layer as an int32 array: traced under jit)."""
        planes = self.planes if planes is None else planes
        return CyclicKVCacheLayerView({k: jnp.asarray(v) for k, v in planes.items()}, jnp.int32(self.layer), self.layout)


def make_cyclic_case(
    geometry: CyclicGeometry, *, written=None, seed: int = 0, poison: str = "nan"
) -> CyclicCase:
    """A state of ``geometry`` whose ring row ``r`` holds positions ``0..written[r]-1`` (the newest
    ``slots`` of them; none by default); ring rows past ``len(written)`` and layer 0 are poison."""
    g = geometry
    rng = np.random.default_rng(seed)
    written = np.zeros(g.rows, np.int32) if written is None else np.asarray(written, np.int32)
    written = np.concatenate([written, np.zeros(g.rows - written.size, np.int32)])
    total = int(written.max()) + 8
    lay = CyclicKVLayout(g.profile, num_layers=2, rows=g.rows, num_kv_heads=g.heads, head_dim=g.head_dim,
                         window=g.window, slots=g.slots)
    planes = poison_planes(lay.plane_shapes(), lay.plane_dtypes(), rng, mode=poison)
    k, v = random_kv(rng, (g.rows, total, g.heads, g.head_dim))
    codes = np_codecs.encode_kv(lay.profile, k, v)
    layer = 1
    for r in range(g.rows):
        for j in range(max(0, written[r] - g.slots), written[r]):
            for name in planes:
                planes[name][layer, r, :, j % g.slots, :] = codes[name][r, j]
    return CyclicCase(lay, planes, layer, written)
