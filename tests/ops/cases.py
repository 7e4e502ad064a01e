"""Builders of poisoned paged/cyclic test states and their numpy expectations.

A paged case scatters each batch row's logical blocks over random physical pages, routes batch rows
through a shuffled set of table rows, and poisons everything the ops must not read: unused pages,
columns past each row's frontier, unused table entries (NaN pages or out-of-range IDs), other layers
and unused table rows.  Expectations are computed with the numpy oracle (``np_codecs``) only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ninfer_kv import PagedKVStorageLayout, PlaneOrder
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

from . import np_codecs

P = 64


def poison_planes(shapes: dict, dtypes: dict, rng, *, mode: str = "nan") -> dict[str, np.ndarray]:
    """Numpy planes full of poison.

    ``mode="nan"``: float planes NaN, uint8 NVFP4 scales 0x7F (NaN as e4m3fn), other bytes random.
    ``mode="bytes"``: uniformly random bytes everywhere (NaN patterns included) for bitwise checks.
    """
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
        out[name] = arr
    return out


def plane_index(order: PlaneOrder, layer: int, pages, cols):
    """Numpy index selecting ``(n, H, X)`` token-heads at (layer, pages[i], :, cols[i], :)."""
    if order is PlaneOrder.PAGE_MAJOR:
        return (layer, pages, slice(None), cols, slice(None))
    return (layer, slice(None), pages, cols, slice(None))


@dataclasses.dataclass
class PagedCase:
    layout: PagedKVStorageLayout
    planes: dict  # numpy
    block_tables: np.ndarray  # (C, L)
    table_rows: np.ndarray  # (B,)
    layer: int
    token_codes: dict  # plane name -> (B, L*P, H, X) codes of every logical position of each row
    kv_lens: np.ndarray  # (B,) tokens present in the planes

    def view(self, layer=None) -> PagedKVBatchLayerView:
        return PagedKVBatchLayerView(
            {k: jnp.asarray(v) for k, v in self.planes.items()},
            jnp.asarray(self.block_tables),
            self.layer if layer is None else layer,
            self.layout,
        )

    def decoded_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 (B, L*P, H, D) K and V of every logical position (oracle codec)."""
        return np_codecs.decode_kv(self.layout.profile.value, self.token_codes)


def make_paged_case(
    profile,
    order,
    *,
    kv_lens,
    num_heads: int = 2,
    head_dim: int = 64,
    logical_pages: int = 3,
    extra_rows: int = 2,
    spare_pages: int = 4,
    num_layers: int = 2,
    layer: int = 1,
    seed: int = 0,
    fill_tokens: bool = True,
    poison: str = "nan",
    mapped_tokens=None,
) -> PagedCase:
    """A batch whose row ``b`` holds ``kv_lens[b]`` tokens in scattered physical pages.

    Blocks covering ``mapped_tokens[b]`` tokens (default ``kv_lens``) are mapped in the table.
    """
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    b = kv_lens.size
    lay = PagedKVStorageLayout(profile, num_layers, num_heads, head_dim, order=order)
    c, L = b + extra_rows, logical_pages
    n = b * L + spare_pages
    planes = poison_planes(lay.plane_shapes(n), lay.plane_dtypes(), rng, mode=poison)
    perm = rng.permutation(n)
    owned = perm[: b * L].reshape(b, L)  # physical pages of each row's blocks, in random order
    spare = perm[b * L :]  # never written: poisoned pages
    table_rows = rng.permutation(c)[:b].astype(np.int32)
    # Unused table rows and unused entries: out-of-range IDs and poisoned pages.
    junk = np.array([n, n + 7, -1, -(2**31), 2**31 - 1] + list(spare), np.int64)
    tables = rng.choice(junk, size=(c, L)).astype(np.int32)
    mapped = kv_lens if mapped_tokens is None else np.asarray(mapped_tokens)
    for i in range(b):
        used = -(-int(mapped[i]) // P)
        tables[table_rows[i], :used] = owned[i, :used]
    k_tok = rng.standard_normal((b, L * P, num_heads, head_dim)).astype(np.float32)
    v_tok = rng.standard_normal((b, L * P, num_heads, head_dim)).astype(np.float32)
    v_tok *= np.float32(3.0)
    token_codes = np_codecs.encode_kv(lay.profile.value, k_tok, v_tok)
    if fill_tokens:
        for i in range(b):
            j = np.arange(kv_lens[i])
            idx = plane_index(lay.order, layer, owned[i, j // P], j % P)
            for name in planes:
                planes[name][idx] = token_codes[name][i, : kv_lens[i]]
    return PagedCase(lay, planes, tables, table_rows, layer, token_codes, kv_lens)


def paged_visible(positions, kv_lens, t: int, num_keys: int) -> np.ndarray:
    """bool (B, T, J): key j visible to query t of row b."""
    qpos = np.asarray(positions)[:, None] + np.arange(t)[None, :]
    j = np.arange(num_keys)
    return (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < np.asarray(kv_lens)[:, None, None])


def expected_paged_append(case: PagedCase, positions, enc: dict, valid) -> dict[str, np.ndarray]:
    """Pre-state planes with each row's first ``valid[b]`` token codes written at (page, column)."""
    out = {k: v.copy() for k, v in case.planes.items()}
    for i in range(len(positions)):
        pos = positions[i] + np.arange(valid[i])
        pages = case.block_tables[case.table_rows[i], pos // P]
        idx = plane_index(case.layout.order, case.layer, pages, pos % P)
        for name in out:
            out[name][idx] = enc[name][i, : valid[i]]
    return out


# -- cyclic --------------------------------------------------------------------------------------


@dataclasses.dataclass
class CyclicCase:
    layout: CyclicKVLayout
    planes: dict
    layer: int
    token_codes: dict  # (rows, total, H, X) codes of every position 0..total-1 of each ring row
    written: np.ndarray  # (rows,) positions 0..written-1 were appended; slot j % slots holds the newest

    def view(self) -> CyclicKVCacheLayerView:
        return CyclicKVCacheLayerView({k: jnp.asarray(v) for k, v in self.planes.items()}, self.layer, self.layout)


def make_cyclic_case(profile, *, written, window: int, slots: int, num_heads=2, head_dim=64, seed=0, total=None):
    rng = np.random.default_rng(seed)
    written = np.asarray(written, np.int32)
    rows = written.size
    total = int(written.max()) + 8 if total is None else total
    lay = CyclicKVLayout(profile, num_layers=2, rows=rows, num_kv_heads=num_heads, head_dim=head_dim, window=window, slots=slots)
    planes = poison_planes(lay.plane_shapes(), lay.plane_dtypes(), rng, mode="nan")
    k_tok = rng.standard_normal((rows, total, num_heads, head_dim)).astype(np.float32)
    v_tok = rng.standard_normal((rows, total, num_heads, head_dim)).astype(np.float32)
    codes = np_codecs.encode_kv(lay.profile.value, k_tok, v_tok)
    layer = 1
    for r in range(rows):
        for j in range(max(0, written[r] - slots), written[r]):
            for name in planes:
                planes[name][layer, r, :, j % slots, :] = codes[name][r, j]
    return CyclicCase(lay, planes, layer, codes, written)


# -- jitted steps --------------------------------------------------------------------------------


def decode_step(impl: str, layout: PagedKVStorageLayout):
    """A jitted model-step slice: append K/V, then attend, planes donated (in-place append)."""
    import jax

    from ninfer_kv import ops

    def step(planes, tables, layer, rows, positions, k, v, valid, q, kv_lens):
        view = PagedKVBatchLayerView(planes, tables, layer, layout)
        view = ops.paged_append(view, rows, positions, k, v, valid, impl=impl)
        return view.planes, ops.paged_attention(q, view, rows, positions, kv_lens, impl=impl)

    return jax.jit(step, donate_argnums=0)


def step_arg_specs(layout: PagedKVStorageLayout, *, batch, t, q_heads, rows, logical_pages, num_pages, dtype="bfloat16"):
    """``jax.ShapeDtypeStruct`` arguments of :func:`decode_step` (lower/compile without buffers)."""
    import jax

    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    planes = {n: s(shape, layout.plane_dtypes()[n]) for n, shape in layout.plane_shapes(num_pages).items()}
    h, d = layout.num_kv_heads, layout.head_dim
    kv = s((batch, t, h, d), dtype)
    vec = s((batch,), i32)
    return (planes, s((rows, logical_pages), i32), s((), i32), vec, vec, kv, kv, vec, s((batch, t, q_heads, d), dtype), vec)
