"""Builders of poisoned, shuffled paged and cyclic test pools for the Pallas kernel tests.

Every pool starts as all-0xFF bytes: NaN in bf16/e4m3fn planes and scales, -1 in int8 codes,
-6/-6 nibbles with a NaN scale in NVFP4.  Appends must leave every byte they do not write as it
was, NaN payloads included.  Real data (encoded by :mod:`ninfer_kv.codecs`, placed with numpy
indexing) goes into layer ``LAYER`` only; the other layer stays poisoned.  Physical pages come in
a random order, spare pages stay poisoned, and table entries a row does not use hold poison IDs
(out-of-range values and IDs of poisoned pages).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv import codecs
from ninfer_kv.layout import PagedKVStorageLayout
from ninfer_kv.ops.reference import attention_over_keys, cyclic_append_reference
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

PROFILES = ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4")
ORDERS = ("page-major", "head-major")
# The default-run cases: every profile, both plane orders, head dims that are not powers of two
# (padded tiles); the slow sweeps take every profile x order.
DEFAULT_CASES = (
    ("bf16", "page-major", 80),
    ("int8-g64", "head-major", 192),
    ("fp8-e4m3fn-row256", "page-major", 96),
    ("nvfp4-g16", "head-major", 80),
    ("k8v4", "page-major", 64),
)
NUM_LAYERS = 2
LAYER = 1
PAGE = 64

# Attention tolerance against the float32 reference.  float32 queries use full-precision float32
# products: only summation order differs.  bfloat16 queries use bfloat16 products (the probability
# tile is rounded to bfloat16 before the P.V product) and a bfloat16 output: a couple of bf16 ulps.
TOL = {jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5), jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2)}


_encode = jax.jit(codecs.encode_kv, static_argnums=0)
_decode = jax.jit(codecs.decode_kv, static_argnums=0)
_attention_over_keys = jax.jit(attention_over_keys, static_argnums=4)


def poisoned(shape, dtype) -> jax.Array:
    """An array of ``shape`` whose bytes are all 0xFF (a non-canonical NaN in bf16 and e4m3fn)."""
    dtype = np.dtype(dtype)
    raw = np.full(tuple(shape) + (dtype.itemsize,), 0xFF, np.uint8)
    return jnp.asarray(raw.view(dtype).reshape(shape))


def as_bytes(x) -> np.ndarray:
    """Raw bytes of an array, so that NaN poison compares equal to itself."""
    a = np.asarray(x)
    return a.view(np.uint8).reshape(a.shape + (-1,)) if a.dtype.itemsize > 1 else a.view(np.uint8)


@dataclasses.dataclass
class PagedCase:
    view: PagedKVBatchLayerView
    table_rows: jax.Array
    kv_lens: np.ndarray


def make_paged_case(
    profile: str,
    order: str,
    *,
    head_dim: int,
    kv_heads: int,
    kv_lens,
    extra_blocks: int = 1,
    seed: int = 0,
) -> PagedCase:
    """A poisoned pool whose row ``b`` holds ``kv_lens[b]`` reference-encoded tokens in layer ``LAYER``.

    ``extra_blocks`` logical blocks past each row's need are mapped too (fresh, poisoned pages), so
    appends may grow into them; entries past those hold poison IDs.
    """
    rs = np.random.RandomState(seed)
    kv_lens = np.asarray(kv_lens, np.int64)
    bsz = len(kv_lens)
    lay = PagedKVStorageLayout(profile, NUM_LAYERS, kv_heads, head_dim, order)
    need = [-(-int(n) // PAGE) + extra_blocks for n in kv_lens]
    width = max(need) + 2
    spare = 3
    n_pages = sum(need) + spare
    phys = rs.permutation(n_pages)
    poison_pages = phys[sum(need):]
    c_rows = bsz + 2
    table = np.empty((c_rows, width), np.int64)
    poison_ids = np.array([2**30, -7, n_pages, *poison_pages])
    table[:] = rs.choice(poison_ids, size=table.shape)
    table_rows = rs.permutation(c_rows)[:bsz]
    cursor = 0
    for b in range(bsz):
        table[table_rows[b], : need[b]] = phys[cursor : cursor + need[b]]
        cursor += need[b]
    dtypes = lay.plane_dtypes()
    planes = {name: np.array(poisoned(shape, dtypes[name])) for name, shape in lay.plane_shapes(n_pages).items()}
    fill_t = max(1, int(kv_lens.max()))
    k = random_tokens(seed + 1000, (bsz, fill_t, kv_heads, head_dim))
    v = random_tokens(seed + 2000, (bsz, fill_t, kv_heads, head_dim))
    enc = {name: np.asarray(a) for name, a in _encode(lay.profile, k, v).items()}  # each (B, t, H, X)
    for b in range(bsz):
        pos = np.arange(int(kv_lens[b]))
        pages = table[table_rows[b], pos // PAGE]
        heads = np.arange(kv_heads)[None, :]
        for name, arr in planes.items():
            vals = enc[name][b, : len(pos)]
            if lay.order.value == "page-major":  # (L, N, H, P, X)
                arr[LAYER, pages[:, None], heads, (pos % PAGE)[:, None]] = vals
            else:  # (L, H, N, P, X)
                arr[LAYER, heads, pages[:, None], (pos % PAGE)[:, None]] = vals
    planes = {n: jnp.asarray(a) for n, a in planes.items()}
    view = PagedKVBatchLayerView(planes, jnp.asarray(table, jnp.int32), LAYER, lay)
    rows = jnp.asarray(table_rows, jnp.int32)
    return PagedCase(view=view, table_rows=rows, kv_lens=kv_lens)


def make_cyclic_view(profile: str, *, head_dim: int, kv_heads: int, rows: int, window: int, slots: int):
    lay = CyclicKVLayout(profile, NUM_LAYERS, rows, kv_heads, head_dim, window, slots)
    planes = {name: poisoned(shape, lay.plane_dtypes()[name]) for name, shape in lay.plane_shapes().items()}
    return CyclicKVCacheLayerView(planes, LAYER, lay)


def fill_cyclic(view, ring_rows, lens, seed: int = 0):
    """Write ``lens[b]`` reference-encoded tokens from position 0 into ring ``ring_rows[b]``."""
    bsz = len(lens)
    lay = view.layout
    fill_t = max(1, int(max(lens)))
    key = jax.random.key(seed + 100)
    k = jax.random.normal(jax.random.fold_in(key, 1), (bsz, fill_t, lay.num_kv_heads, lay.head_dim), jnp.float32)
    v = jax.random.normal(jax.random.fold_in(key, 2), (bsz, fill_t, lay.num_kv_heads, lay.head_dim), jnp.float32)
    return jax.jit(cyclic_append_reference)(
        view, jnp.asarray(ring_rows, jnp.int32), jnp.zeros((bsz,), jnp.int32), k, v, jnp.asarray(lens, jnp.int32)
    )


def random_tokens(seed: int, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale
    return x.astype(dtype)


def assert_planes_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        g, w = as_bytes(got[name]), as_bytes(want[name])
        assert g.shape == w.shape, name
        bad = np.argwhere(np.any(g != w, axis=-1) if g.ndim > np.asarray(want[name]).ndim else g != w)
        assert bad.size == 0, f"plane {name}: {len(bad)} elements differ, first at {bad[:3].tolist()}"


def assert_close(got, want, q_dtype) -> None:
    tol = TOL[jnp.dtype(q_dtype)]
    g = np.asarray(jnp.asarray(got, jnp.float32))
    w = np.asarray(jnp.asarray(want, jnp.float32))
    assert np.isfinite(g).all(), "non-finite values in the kernel output"
    np.testing.assert_allclose(g, w, **tol)


# -- out-of-range inputs (SEMANTICS A) -------------------------------------------------------------


def sanitized_for_reference(view: PagedKVBatchLayerView, table_rows, valid):
    """Inputs on which the reference append does what the kernels must do with the raw ones.

    A ``table_rows`` entry outside ``[0, C)`` becomes row 0 with ``valid`` 0 (the row is inert);
    every table entry outside ``[0, N)`` becomes ``N`` (dropped by the reference's scatter).
    """
    table = np.asarray(view.block_tables)
    n = view.num_pages
    rows = np.asarray(table_rows)
    row_ok = (rows >= 0) & (rows < table.shape[0])
    clean = np.where((table >= 0) & (table < n), table, n).astype(np.int32)
    return (
        view.replace(block_tables=jnp.asarray(clean)),
        jnp.asarray(np.where(row_ok, rows, 0), jnp.int32),
        jnp.asarray(np.where(row_ok, np.asarray(valid), 0), jnp.int32),
    )


def expected_paged_attention(q, view: PagedKVBatchLayerView, table_rows, positions, kv_lens, sm_scale=None):
    """float32 dense paged attention with the out-of-range rules of the kernels (an independent oracle).

    Row ``b`` with ``table_rows[b]`` outside ``[0, C)`` sees no key; a block whose table entry is
    outside ``[0, N)`` is invisible; ``kv_lens`` is clipped to ``[0, L * 64]``.
    """
    lay = view.layout
    table = np.asarray(view.block_tables)
    c_rows, width = table.shape
    n = view.num_pages
    rows = np.asarray(table_rows)
    row_ok = (rows >= 0) & (rows < c_rows)
    entries = table[np.where(row_ok, rows, 0)]  # (B, L)
    page_ok = (entries >= 0) & (entries < n)
    pages = np.where(page_ok, entries, 0)
    gathered = {}
    for name, plane in view.planes.items():
        layer = np.asarray(plane)[view.layer] if lay.order.value == "page-major" else np.moveaxis(np.asarray(plane)[view.layer], 0, 1)
        x = layer[pages]  # (B, L, H, P, X)
        bsz, nblk, h, p, ext = x.shape
        gathered[name] = jnp.asarray(np.transpose(x, (0, 2, 1, 3, 4)).reshape(bsz, h, nblk * p, ext))
    k, v = _decode(lay.profile, gathered)
    d = q.shape[-1]
    j = np.arange(width * PAGE)
    kv_eff = np.clip(np.asarray(kv_lens), 0, width * PAGE) * row_ok
    qpos = np.asarray(positions)[:, None] + np.arange(q.shape[1])[None, :]
    visible = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < kv_eff[:, None, None])
    visible &= np.repeat(page_ok, PAGE, axis=1)[:, None, :]
    scale = (1.0 / d**0.5) if sm_scale is None else sm_scale
    return _attention_over_keys(q, k, v, jnp.asarray(visible), float(scale)).astype(q.dtype)
