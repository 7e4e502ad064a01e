"""Shared helpers of the store tests: tiny plans, the caller-owned device state of each store (its
round works applied in order), a device writer that goes through the device block tables (as a
kernel would), content readers and snapshot comparison."""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv import ops
from ninfer_kv.ops.views import PagedKVBatchLayerView
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, SpeculativeConfig, plan_kv_cache
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.device import KVDeviceState, apply_work, apply_work_jit
from ninfer_kv.store import KVStore
from ninfer_kv.device import allocate_state

P = 64

CONFIGS = {
    "ordinary": None,
    "mtp": SpeculativeConfig(method="mtp", draft_window=3, mtp_layers=1),
    "dflash": SpeculativeConfig(method="dflash", draft_full_layers=1, draft_kv_heads=1, draft_head_dim=8),
}


def tiny_plan(backend: str = "ordinary", *, max_context=256, max_concurrency=3, pages=9, profile="bf16", head_dim=8, layers=2):
    model = ModelKVConfig(num_layers=layers, num_kv_heads=1, head_dim=head_dim, profile=profile)
    return plan_kv_cache(
        model,
        max_context=max_context,
        max_concurrency=max_concurrency,
        policy=ExplicitCapacity(pages * P),
        speculative=CONFIGS[backend],
    )


class Device:
    """The caller side of one store: its :class:`KVDeviceState`, advanced by every round work."""

    def __init__(self, store: KVStore):
        self.store = store
        self.state: KVDeviceState = allocate_state(store)
        self.works = 0
        pages = max(store.pool(k).capacity for k in store.pool_kinds)
        self.pad = (store.max_concurrency * store.logical_pages, pages, pages) if pages <= 64 else None

    def sync(self) -> KVDeviceState:
        """Take the store's pending work and apply it (jitted, donated); returns the new state.

        Nothing pending: nothing is taken, so arrays read from the state stay valid."""
        if all(p.empty for p in self.store.pending_work().values()):
            return self.state
        work = self.store.take_work()
        if self.pad:  # one shape per store: one compilation (bucketing is tested in test_compile_count)
            work = work.pad_to(*self.pad)
        self.state = apply_work_jit(self.state, work)
        self.works += 1
        return self.state


@functools.lru_cache(maxsize=None)
def model_step(layout, impl: str = "reference", attend: bool = False):
    """A model step over the Main pool, jitted with the state donated: apply the round's work, append
    ``k`` (as keys and values) for every batch row and, with ``attend``, return the attention of ``k``
    as queries.  ``step(state, work, table_rows, positions, valid, k) -> state`` or ``(state, out)``."""
    main = PoolKind.MAIN

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, work, table_rows, positions, valid, k):
        state = apply_work(state, work)
        view = PagedKVBatchLayerView(state.planes[main], state.tables[main], 0, layout)
        view = ops.paged_append(view, table_rows, positions, k, k, valid, impl=impl)
        new = state.replace_planes(main, view.planes)
        if not attend:
            return new
        return new, ops.paged_attention(k, view, table_rows, positions, positions + valid, impl=impl)

    return step


_DEVICES: "weakref.WeakKeyDictionary[KVStore, Device]" = weakref.WeakKeyDictionary()


def device(store: KVStore) -> Device:
    """The (lazily created) device side of ``store``."""
    dev = _DEVICES.get(store)
    if dev is None:
        dev = _DEVICES[store] = Device(store)
    return dev


def sync(store: KVStore) -> KVDeviceState:
    """Apply every pending round work of ``store`` to its device state; returns the state."""
    return device(store).sync()


def planes_of(store: KVStore, kind) -> dict:
    """The device planes of ``kind`` after every pending work was applied."""
    return dict(sync(store).pool_planes(kind))


def tables_of(store: KVStore) -> dict:
    """The device block tables after every pending work was applied."""
    return dict(sync(store).tables)


def set_planes(store: KVStore, kind, planes) -> None:
    dev = device(store)
    dev.state = dev.state.replace_planes(kind, planes)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@functools.partial(jax.jit, static_argnames=("page_axis",), donate_argnums=(0,))
def _write_cells(planes, pages, cols, values, *, page_axis):
    out = {}
    for name, plane in planes.items():
        # write raw bits so untouched cells (random NaN payloads included) keep their exact bytes
        bits = _UINT[jnp.dtype(plane.dtype).itemsize]
        x = jax.lax.bitcast_convert_type(plane, bits)
        n = x.shape[page_axis]
        p = jnp.where(pages >= 0, pages, n)
        v = jax.lax.bitcast_convert_type(values.astype(plane.dtype), bits)
        if page_axis == 1:  # (Lyr, N, H, P, X): advanced axes not adjacent -> (U, Lyr, H, X)
            x = x.at[:, p, :, cols, :].set(v[:, None, None, None], mode="drop")
        else:  # (Lyr, H, N, P, X): adjacent advanced axes -> (Lyr, H, U, X)
            x = x.at[:, :, p, cols, :].set(v[None, None, :, None], mode="drop")
        out[name] = jax.lax.bitcast_convert_type(x, plane.dtype)
    return out


WRITE_PAD = 256


def write_tokens(store: KVStore, kind, row: int, start: int, values) -> None:
    """Write ``values`` at positions ``start..`` of ``row`` in every plane/layer, translating positions
    through the *device* block table (every pending work applied) exactly like a paged-append kernel."""
    values = np.asarray(values, np.float32)
    write_positions(store, kind, np.full(values.size, row), start + np.arange(values.size), values)


def write_positions(store: KVStore, kind, rows, positions, values) -> None:
    """Write ``values[i]`` at position ``positions[i]`` of row ``rows[i]`` (distinct cells)."""
    values = np.asarray(values, np.float32)
    if values.size == 0:
        return
    state = sync(store)
    table = np.asarray(state.table(kind))
    pos = np.asarray(positions, np.int64)
    pages = table[np.asarray(rows, np.int64), pos // P].astype(np.int32)
    cols = (pos % P).astype(np.int32)
    axis = store.layout(kind).order.page_axis
    planes = dict(state.pool_planes(kind))
    for s in range(0, values.size, WRITE_PAD):
        n = min(WRITE_PAD, values.size - s)
        pg = np.full(WRITE_PAD, -1, np.int32)
        cl = np.zeros(WRITE_PAD, np.int32)
        vl = np.zeros(WRITE_PAD, np.float32)
        pg[:n], cl[:n], vl[:n] = pages[s : s + n], cols[s : s + n], values[s : s + n]
        planes = _write_cells(planes, pg, cl, vl, page_axis=axis)
    set_planes(store, kind, planes)


def read_cells(planes_np: dict, axis: int, pages: np.ndarray, cols: np.ndarray) -> list[np.ndarray]:
    """Per plane, the values at (page, col) for every layer/head/x: arrays of shape (U, ...)."""
    out = []
    for x in planes_np.values():
        if axis == 1:
            out.append(x[:, pages, :, cols, :].astype(np.float32))  # (U, Lyr, H, X)
        else:
            out.append(np.moveaxis(x[:, :, pages, cols, :], 2, 0).astype(np.float32))
    return out


def space_content_ok(store: KVStore, kind, physical_pages: np.ndarray, expected: list, planes_np=None) -> bool:
    """True iff every plane/layer holds ``expected[i]`` at logical position i of the membership."""
    n = len(expected)
    if n == 0:
        return True
    planes_np = planes_np if planes_np is not None else {k: np.asarray(v) for k, v in planes_of(store, kind).items()}
    pos = np.arange(n)
    pages = physical_pages[pos // P]
    cols = pos % P
    exp = np.asarray(expected, np.float32)
    axis = store.layout(kind).order.page_axis
    for got in read_cells(planes_np, axis, pages, cols):
        if not np.all(got == exp.reshape((n,) + (1,) * (got.ndim - 1))):
            return False
    return True


def assert_same(a, b, path="state"):
    """Deep equality of snapshots (dicts, lists, tuples, numpy arrays, scalars)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a) ^ set(b)} differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def random_fill(store: KVStore, seed: int = 0) -> None:
    """Fill every plane of every pool with random bytes (any dtype)."""
    rng = np.random.default_rng(seed)
    for kind in store.pool_kinds:
        planes = {}
        for name, x in planes_of(store, kind).items():
            raw = rng.integers(0, 256, size=x.size * x.dtype.itemsize, dtype=np.uint8)
            planes[name] = jnp.asarray(raw.view(x.dtype).reshape(x.shape))
        set_planes(store, kind, planes)


def page_bytes(planes_np: dict, axis: int, page: int) -> list[bytes]:
    return [np.take(x, page, axis=axis).tobytes() for x in planes_np.values()]


def logical_page_planes(store: KVStore, kind, page, planes_np: dict | None = None) -> dict:
    """Per plane, one logical page's payload ``(layers, H, P, X)`` read from its Device replica, or
    from its Host replica (the arena's packed bytes) when it has no Device replica."""
    lease = page.device_lease
    if lease is not None:
        planes_np = planes_np if planes_np is not None else {k: np.asarray(v) for k, v in planes_of(store, kind).items()}
        axis = store.layout(kind).order.page_axis
        return {name: np.take(x, lease.page, axis=axis) for name, x in planes_np.items()}
    replica = page.host_replica
    assert replica is not None, f"page {page} has no replica at all"
    from ninfer_kv.host import host_layout_of

    views = host_layout_of(store.layout(kind)).page_planes(store.host_arena.view(replica.extent))
    return {name: v[replica.page] for name, v in views.items()}


def logical_page_bytes(store: KVStore, kind, page, planes_np: dict | None = None) -> list[bytes]:
    return [x.tobytes() for x in logical_page_planes(store, kind, page, planes_np).values()]


def content_ok(store: KVStore, kind, handle, expected: list, planes_np=None) -> bool:
    """Like :func:`space_content_ok` for a sequence or checkpoint whose pages may be Host-only."""
    space = store.address_space(handle, kind)
    phys = space.physical_pages
    if (phys >= 0).all():
        return space_content_ok(store, kind, phys, expected, planes_np)
    exp = np.asarray(expected, np.float32)
    for b, page in enumerate(space.pages()):
        vals = exp[b * P : (b + 1) * P]
        for x in logical_page_planes(store, kind, page, planes_np).values():
            got = x[:, :, : vals.size, :].astype(np.float32)  # (layers, H, cols, X)
            if not np.all(got == vals.reshape(1, 1, -1, 1)):
                return False
    return True
