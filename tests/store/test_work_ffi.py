"""The CPU lowering of ``apply_work`` (two in-place custom calls) gives the bits of its jnp reference.

Random works over random states: table updates with out-of-range and negative indices (dropped, or
wrapped once like ``.at[].set(mode="drop")``), COW copies whose sources are other entries'
destinations (each source read before any write), Host restores of whole and partial pages,
padding entries, several pools of both plane orders with float and byte planes, and works out of
order or of another store (nothing written, tables poisoned, the first slip recorded).  Every
plane byte (NaN payloads included), every table entry and the order record must be equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.device.state import KVDeviceState, sync_record
from ninfer_kv.device.work import apply_work, apply_work_reference
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.schema.layout import PagedKVStorageLayout, word_dtype
from ninfer_kv.schema.round_work import PoolWork, RoundWork

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")

P = 64
C, L = 5, 4
POOLS = {
    PoolKind.MAIN: PagedKVStorageLayout("k8v4", 2, 2, 32, "page-major"),
    PoolKind.DRAFT_FULL: PagedKVStorageLayout("bf16", 1, 2, 16, "head-major"),
}
PAGES = {PoolKind.MAIN: 9, PoolKind.DRAFT_FULL: 7}

_ffi = jax.jit(apply_work)
_ref = jax.jit(apply_work_reference)


def _random_state(rng, serial: int, owner: int) -> KVDeviceState:
    planes, tables = {}, {}
    for kind, lay in POOLS.items():
        planes[kind] = {}
        for name, shape in lay.plane_shapes(PAGES[kind]).items():
            dt = np.dtype(lay.plane_dtypes()[name])
            raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
            planes[kind][name] = jnp.asarray(raw.view(dt).reshape(shape))  # random bytes, NaN patterns included
        tables[kind] = jnp.asarray(rng.integers(-1, PAGES[kind], (C, L)).astype(np.int32))
    return KVDeviceState(planes, tables, layouts=tuple(POOLS.items()), sync=jnp.asarray(sync_record(serial, (-1, -1, -1), owner)))


def _random_pool_work(rng, kind: PoolKind) -> PoolWork:
    lay, n = POOLS[kind], PAGES[kind]
    u = int(rng.integers(0, 12))
    tables = np.stack([rng.integers(-C, C + 3, u), rng.integers(-L, L + 2, u), rng.integers(-1, n, u)]).astype(np.int32)
    # distinct destinations: sources may be other entries' destinations (read before the work)
    dst = rng.permutation(n)
    k = int(rng.integers(0, 4))
    r = int(rng.integers(0, 4))
    copies = np.stack([rng.integers(0, n, k), dst[:k], rng.integers(0, P + 1, k)]).astype(np.int32)
    restores = np.stack([dst[k : k + r], rng.integers(0, P + 1, r)]).astype(np.int32)
    if k:
        copies[1, -1] = n  # a padding entry: destination out of range
    payload = {}
    for spec in lay.planes:
        w = np.dtype(word_dtype(spec.dtype))
        shape = (r, lay.num_layers, lay.num_kv_heads, P, spec.extent)
        payload[spec.name] = rng.integers(0, np.iinfo(w).max, size=shape, dtype=np.uint64).astype(w)
    return PoolWork(tables, copies, restores, payload, pad_row=C, pad_page=n)


def _bytes(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_same(a: KVDeviceState, b: KVDeviceState, seed: int) -> None:
    np.testing.assert_array_equal(np.asarray(a.sync), np.asarray(b.sync), err_msg=f"seed {seed}: order record")
    for kind in POOLS:
        np.testing.assert_array_equal(np.asarray(a.tables[kind]), np.asarray(b.tables[kind]),
                                      err_msg=f"seed {seed}: {kind.value} table")
        for name in a.planes[kind]:
            np.testing.assert_array_equal(_bytes(a.planes[kind][name]), _bytes(b.planes[kind][name]),
                                          err_msg=f"seed {seed}: {kind.value} plane {name}")


@pytest.mark.parametrize("seed", range(12))
def test_the_cpu_lowering_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    serial = int(rng.integers(0, 5))
    owner = int(rng.choice([0, 7]))
    # in order, a skipped or repeated serial, another store, a poisoned state
    case = seed % 4
    work_serial = serial if case != 1 else serial + int(rng.choice([-1, 1]))
    work_store = 7 if case != 2 else 9
    state_serial = -1 if case == 3 else serial
    state = _random_state(rng, state_serial, owner if case != 2 else 7)
    work = RoundWork(work_serial, {kind: _random_pool_work(rng, kind) for kind in POOLS}, work_store)
    got, want = _ffi(state, work), _ref(state, work)
    _assert_same(got, want, seed)
    changed = any(not np.array_equal(_bytes(got.planes[k][n]), _bytes(state.planes[k][n]))
                  for k in POOLS for n in state.planes[k])
    if case != 0:  # out of order or another store: nothing written, every entry the sentinel
        assert not changed
        assert all((np.asarray(got.tables[k]) == -1).all() for k in POOLS)
        assert int(got.serial) == -1


def _empty_pool_work(kind: PoolKind) -> PoolWork:
    lay = POOLS[kind]
    payload = {spec.name: np.zeros((0, lay.num_layers, lay.num_kv_heads, P, spec.extent), word_dtype(spec.dtype))
               for spec in lay.planes}
    return PoolWork(np.zeros((3, 0), np.int32), np.zeros((3, 0), np.int32), np.zeros((2, 0), np.int32), payload,
                    pad_row=C, pad_page=PAGES[kind])


def test_an_in_order_work_writes_what_it_names():
    """One table entry, one whole-page copy, one 10-column restore: exactly those bytes change."""
    rng = np.random.default_rng(100)
    state = _random_state(rng, 3, 7)
    kind, lay = PoolKind.MAIN, POOLS[PoolKind.MAIN]
    payload = {spec.name: np.full((1, lay.num_layers, lay.num_kv_heads, P, spec.extent), 3, word_dtype(spec.dtype))
               for spec in lay.planes}
    pw = PoolWork(np.array([[1], [2], [5]], np.int32), np.array([[0], [1], [P]], np.int32),
                  np.array([[2], [10]], np.int32), payload, pad_row=C, pad_page=PAGES[kind])
    work = RoundWork(3, {kind: pw, PoolKind.DRAFT_FULL: _empty_pool_work(PoolKind.DRAFT_FULL)}, 7)
    got, want = _ffi(state, work), _ref(state, work)
    _assert_same(got, want, 100)
    assert int(got.tables[kind][1, 2]) == 5 and int(got.serial) == 4
    k, k0 = _bytes(got.planes[kind]["k"]), _bytes(state.planes[kind]["k"])
    np.testing.assert_array_equal(k[:, 1], k0[:, 0])  # page 0 copied whole onto page 1
    assert (k[:, 2, :, :10] == 3).all()  # the restore's 10 columns
    np.testing.assert_array_equal(k[:, 2, :, 10:], k0[:, 2, :, 10:])  # the rest of page 2 untouched
    untouched = [n for n in range(PAGES[kind]) if n not in (1, 2)]
    np.testing.assert_array_equal(k[:, untouched], k0[:, untouched])
