"""Builders of poisoned paged and cyclic states for the FFI kernel tests.

Everything an op must not read is poisoned: pages no row maps, columns past each row's frontier,
table entries past each row's last block (poisoned pages or out-of-range IDs), the other layer and
unused table rows.  Float planes are poisoned with NaN, NVFP4 scales with 0x7F (NaN as e4m3fn).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_kv import ffi_ops
from ninfer_kv.layout import PagedKVStorageLayout
from ninfer_kv.ops import reference
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

P = 64
PROFILES = ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4")
ORDERS = ("page-major", "head-major")

# (profile, order) pairs of the default run: every profile once, both orders; the other pairs run
# with -m slow.
DEFAULT_PAIRS = (
    ("bf16", "page-major"),
    ("int8-g64", "head-major"),
    ("fp8-e4m3fn-row256", "page-major"),
    ("nvfp4-g16", "head-major"),
    ("k8v4", "page-major"),
)

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

# One jitted function per op and implementation; the layout is static pytree metadata, so each
# (layout, shapes) pair compiles once per session.
ffi_paged_append = jax.jit(ffi_ops.paged_append)
ref_paged_append = jax.jit(reference.paged_append_reference)
ffi_paged_attention = jax.jit(ffi_ops.paged_attention, static_argnames="sm_scale")
ref_paged_attention = jax.jit(reference.paged_attention_reference, static_argnames="sm_scale")
ffi_cyclic_append = jax.jit(ffi_ops.cyclic_append)
ref_cyclic_append = jax.jit(reference.cyclic_append_reference)
ffi_cyclic_attention = jax.jit(ffi_ops.cyclic_attention, static_argnames="sm_scale")
ref_cyclic_attention = jax.jit(reference.cyclic_attention_reference, static_argnames="sm_scale")


def sweep(values, default) -> list:
    """``values`` as pytest parameters; those not in ``default`` are marked slow (``-m slow``)."""
    out = []
    for v in values:
        args = v if isinstance(v, tuple) else (v,)
        out.append(pytest.param(*args) if v in default else pytest.param(*args, marks=pytest.mark.slow))
    return out


def profile_order_pairs() -> list:
    """Every (profile, order) pair; DEFAULT_PAIRS run by default."""
    return sweep([(p, o) for p in PROFILES for o in ORDERS], DEFAULT_PAIRS)


def raw_bytes(x) -> np.ndarray:
    """The bytes of an array (NaN payloads included), for bit-exact comparisons."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.view(np.uint8).reshape(-1)


def assert_planes_identical(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        ra, rb = raw_bytes(a[name]), raw_bytes(b[name])
        if not np.array_equal(ra, rb):
            bad = np.flatnonzero(ra != rb)
            raise AssertionError(
                f"plane {name!r}: {bad.size} of {ra.size} bytes differ (first at byte {bad[0]}: "
                f"ffi {ra[bad[0]]:#04x}, reference {rb[bad[0]]:#04x})"
            )


def poison(shape, dtype, name: str, rng) -> np.ndarray:
    """Poison of one plane: NaN for float planes, 0x7F for NVFP4 scales, random bytes otherwise."""
    dtype = np.dtype(dtype)
    if dtype in (BF16, E4M3):
        return np.full(shape, np.nan, dtype)
    if name.endswith("_scale"):
        return np.full(shape, 0x7F, np.uint8)
    return rng.integers(0, 256, size=shape, dtype=np.uint8).view(dtype)


def valid_codes(spec, shape, rng) -> np.ndarray:
    """Random finite codes (or scales) of one plane, in ranges a real quantizer produces."""
    dt = np.dtype(spec.dtype)
    if spec.role == "scale":
        if dt == BF16:
            return rng.uniform(0.005, 0.05, shape).astype(BF16)
        return rng.integers(0x28, 0x40, shape).astype(np.uint8)  # e4m3fn 2^-2 .. 1.875
    if dt == BF16:
        return rng.standard_normal(shape).astype(BF16)
    if dt == E4M3:
        return rng.uniform(-448, 448, shape).astype(E4M3)
    if dt == np.int8:
        return rng.integers(-127, 128, shape).astype(np.int8)
    return rng.integers(0, 256, shape).astype(np.uint8)  # packed e2m1: every byte is valid


@dataclasses.dataclass
class PagedState:
    layout: PagedKVStorageLayout
    planes: dict  # numpy
    block_tables: np.ndarray  # int32 (C, L)
    table_rows: np.ndarray  # int32 (B,)
    kv_lens: np.ndarray  # int32 (B,) keys written for each batch row
    layer: int

    def view(self, layer=None) -> PagedKVBatchLayerView:
        return PagedKVBatchLayerView(
            {k: jnp.asarray(v) for k, v in self.planes.items()},
            jnp.asarray(self.block_tables),
            self.layer if layer is None else layer,
            self.layout,
        )


def paged_state(
    profile: str,
    order: str,
    *,
    kv_lens,
    heads: int = 2,
    head_dim: int = 64,
    layers: int = 2,
    layer: int = 1,
    spare_pages: int = 5,
    logical_pages: int | None = None,
    rng,
) -> PagedState:
    """A pool whose batch row b holds kv_lens[b] valid keys on shuffled physical pages.

    Table rows are shuffled (batch row b uses table row table_rows[b] of C = B + 1 rows); entries
    past a row's last block point at poisoned pages or hold out-of-range IDs; the column after each
    row's frontier, the other layers, spare pages and the unused table row are poison.
    """
    kv_lens = np.asarray(kv_lens, np.int32)
    b = kv_lens.size
    lay = PagedKVStorageLayout(profile, layers, heads, head_dim, order)
    blocks = [-(-int(n) // P) for n in kv_lens]
    L = logical_pages or max(max(blocks), 1) + 1
    used = sum(blocks)
    n = used + spare_pages
    perm = rng.permutation(n)
    shapes, dtypes = lay.plane_shapes(n), lay.plane_dtypes()
    planes = {name: poison(shapes[name], dtypes[name], name, rng) for name in shapes}
    c = b + 1
    table_rows = rng.permutation(c)[:b].astype(np.int32)
    bt = np.empty((c, L), np.int32)
    junk = np.array([n + 7, -3, 2**30, n], np.int64)
    bt[:] = rng.choice(np.concatenate([perm[used:], junk]), size=(c, L)).astype(np.int32)
    cursor = 0
    for i in range(b):
        for blk in range(blocks[i]):
            page = int(perm[cursor])
            cursor += 1
            bt[table_rows[i], blk] = page
            cols = min(P, int(kv_lens[i]) - blk * P)
            for spec in lay.planes:
                x = planes[spec.name]
                if lay.order.value == "page-major":
                    x[layer, page, :, :cols, :] = valid_codes(spec, (heads, cols, spec.extent), rng)
                else:
                    x[layer, :, page, :cols, :] = valid_codes(spec, (heads, cols, spec.extent), rng)
    return PagedState(lay, planes, bt, table_rows, kv_lens, layer)


def empty_paged_pool(profile: str, order: str, *, batch: int, logical_pages: int, heads=2, head_dim=64, layers=2, rng):
    """A poisoned pool with each batch row owning `logical_pages` shuffled pages (for appends)."""
    lay = PagedKVStorageLayout(profile, layers, heads, head_dim, order)
    c = batch + 1
    n = c * logical_pages + 3
    shapes, dtypes = lay.plane_shapes(n), lay.plane_dtypes()
    planes = {name: poison(shapes[name], dtypes[name], name, rng) for name in shapes}
    bt = rng.permutation(n)[: c * logical_pages].reshape(c, logical_pages).astype(np.int32)
    table_rows = rng.permutation(c)[:batch].astype(np.int32)
    return lay, planes, bt, table_rows


def cyclic_state(profile: str, *, rows: int, window: int, slots: int, heads=2, head_dim=64, layers=2, rng):
    """Cyclic planes full of valid random codes (every slot holds a key), plus their layout."""
    lay = CyclicKVLayout(profile, layers, rows, heads, head_dim, window, slots)
    planes = {p.name: valid_codes(p, lay.plane_shapes()[p.name], rng) for p in lay.planes}
    return lay, planes


def cyclic_view(lay: CyclicKVLayout, planes: dict, layer) -> CyclicKVCacheLayerView:
    return CyclicKVCacheLayerView({k: jnp.asarray(v) for k, v in planes.items()}, layer, lay)


def assert_close_to_reference(out, ref, *, rtol: float = 1e-5, atol_frac: float = 1e-5) -> None:
    """float32 agreement: |out - ref| <= rtol * |ref| + atol_frac * max|ref| elementwise."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "the FFI output has non-finite values (poison was read)"
    scale = max(float(np.abs(ref).max()), 1e-30)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol_frac * scale)
