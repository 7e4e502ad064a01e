"""Mesh checks run in a subprocess with 8 forced host devices (the rest of the suite keeps one).

``python worker.py CHECK [CHECK ...]`` runs the named checks in one process (one JAX start), prints
one line per check (``NAME: N checks passed`` or ``NAME: FAILED`` and the traceback) and exits 0
when every one passed.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv import ops  # noqa: E402
from ninfer_kv.ops.views import PagedKVBatchLayerView  # noqa: E402
from ninfer_kv.schema.layout import PagedKVStorageLayout  # noqa: E402
from ninfer_kv.device.mesh import KVMesh  # noqa: E402
from ninfer_kv.device.sharded_ops import sharded_apply_work, sharded_paged_append, sharded_paged_attention  # noqa: E402
from ninfer_kv.schema.errors import KVStoreError  # noqa: E402
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, plan_kv_cache_mesh  # noqa: E402
from ninfer_kv.schema.kinds import PoolKind  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402
from ninfer_kv.device import KVDeviceState, apply_work_jit  # noqa: E402
from ninfer_kv.store import KVStore  # noqa: E402
from ninfer_kv.store.sharded import CrossShardError, ShardedKVStore  # noqa: E402
from ninfer_kv.device import allocate_state, offload_checkpoint, take_step_work
from ninfer_kv.ops.views import allocate_planes

PROFILES = tuple(p.value for p in KVProfile)  # every profile of the spec table
ORDERS = ("page-major", "head-major")
D_HEAD = 64
T_TOK = 80  # tokens per row: one full page and a partial one


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def _same(a, b, what: str) -> None:
    x, y = _bits(a), _bits(b)
    if x.shape != y.shape or not np.array_equal(x, y):
        fa, fb = np.asarray(a, np.float32), np.asarray(b, np.float32)
        bad = np.argwhere(~((fa == fb) | (np.isnan(fa) & np.isnan(fb))))
        raise AssertionError(f"{what}: sharded result differs from one device at {bad[:4].tolist()} "
                             f"({bad.shape[0]} entries, max |diff| {np.nanmax(np.abs(fa - fb))})")


def _deep_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _global_state(kv_mesh, layout, n_pages: int, tables: np.ndarray):
    planes = allocate_planes(layout, n_pages, fill=float("nan"))
    kind = PoolKind.MAIN
    state = KVDeviceState(planes={kind: planes}, tables={kind: jnp.asarray(tables)}, serial=jnp.zeros((), jnp.int32),
                          layouts=((kind, layout),))
    return jax.device_put(state, kv_mesh.state_shardings(state))


def ops_equal(spec: str, heads: int, impls: tuple[str, ...], profiles=PROFILES, one_order: bool = False) -> int:
    """Append + attention for every profile and order on ``spec``: bit-equal to one device.  With
    ``one_order`` the ``i``-th profile runs in plane order ``ORDERS[i % 2]`` only."""
    kv_mesh = KVMesh(spec)
    dd, tt = kv_mesh.data, kv_mesh.model
    stored = max(heads, tt)
    rep = stored // heads
    n_local, c_local, logical = 4, 2, 2
    rng = np.random.default_rng(dd * 10 + tt)
    # each shard: its own page IDs in random order, unused entries poisoned out of range
    local = np.stack([rng.permutation(n_local)[: c_local * logical].reshape(c_local, logical) for _ in range(dd)])
    tables_local = local.reshape(dd * c_local, logical).astype(np.int32)
    tables_single = (local + (np.arange(dd) * n_local)[:, None, None]).reshape(dd * c_local, logical).astype(np.int32)
    b_local = 2
    rows = np.array([d * c_local + i for d in range(dd) for i in (1, 0)], np.int32)
    valid = rng.integers(1, T_TOK + 1, size=dd * b_local).astype(np.int32)
    valid[0] = T_TOK
    pos = np.zeros(dd * b_local, np.int32)
    hq = 2 * stored
    k = rng.standard_normal((dd * b_local, T_TOK, heads, D_HEAD)).astype(np.float32)
    v = rng.standard_normal((dd * b_local, T_TOK, heads, D_HEAD)).astype(np.float32)
    q = rng.standard_normal((dd * b_local, T_TOK, hq, D_HEAD)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    checks = 0
    for i, profile in enumerate(profiles):
        # every other profile attends with a window across the page boundary, a soft cap and sinks
        # (sharded over the model axis with the query heads)
        variant = dict(window=70, soft_cap=4.0, sinks=jnp.asarray(sinks)) if i % 2 else {}
        for order in (ORDERS[i % 2],) if one_order else ORDERS:
            lay_local = PagedKVStorageLayout(profile, 1, stored // tt, D_HEAD, order)
            lay_stored = PagedKVStorageLayout(profile, 1, stored, D_HEAD, order)
            lay_single = PagedKVStorageLayout(profile, 1, heads, D_HEAD, order)
            for impl in impls:
                state = _global_state(kv_mesh, lay_stored, dd * n_local, tables_local)

                @jax.jit
                def sharded(state, rows, pos, valid, q, k, v):
                    state = sharded_paged_append(kv_mesh, state, 0, lay_local, rows, pos, k, v, valid, impl=impl)
                    out = sharded_paged_attention(kv_mesh, q, state, 0, lay_local, rows, pos, valid, impl=impl,
                                                  **variant)
                    return state, out

                @jax.jit
                def single(planes, table, rows, pos, valid, q, k, v):
                    view = PagedKVBatchLayerView(planes, table, 0, lay_single)
                    view = ops.paged_append(view, rows, pos, k, v, valid, impl=impl)
                    return view.planes, ops.paged_attention(q, view, rows, pos, valid, impl=impl, **variant)

                s_state, s_out = sharded(state, rows, pos, valid, q, k, v)
                planes1 = allocate_planes(lay_single, dd * n_local, fill=float("nan"))
                rows1 = rows  # the same global rows index the single device's (D * C_local, L) table
                p1, o1 = single(planes1, jnp.asarray(tables_single), rows1, pos, valid,
                                q[:, :, :: 1], k, v)
                # GQA: query head j reads KV head j // (hq / heads) on one device; the sharded run's
                # stored head j // (hq / stored) is a copy of that same head
                if impl == "reference":  # XLA's CPU dot tiles by shape: float32 sums may round differently
                    np.testing.assert_allclose(np.asarray(s_out), np.asarray(o1), rtol=1e-5, atol=1e-6,
                                               err_msg=f"{spec} {profile} {order} reference attention")
                else:
                    _same(s_out, o1, f"{spec} {profile} {order} {impl} attention")
                head_axis = lay_stored.order.head_axis
                for name, plane in s_state.planes[PoolKind.MAIN].items():
                    got = np.take(np.asarray(plane), np.arange(0, stored, rep), axis=head_axis)
                    _same(got, p1[name], f"{spec} {profile} {order} {impl} plane {name}")
                checks += 1
    return checks


def hlo_no_collectives() -> int:
    """A sharded decode step (apply_work + append + attention, FFI and reference) compiles to HLO
    with no all-gather / all-reduce / all-to-all / collective-permute."""
    n = 0
    for spec in ("data=2,model=4", "data=8,model=1", "data=1,model=8"):
        kv_mesh = KVMesh(spec)
        plan = plan_kv_cache_mesh(ModelKVConfig(2, 8, D_HEAD, "k8v4"), kv_mesh, max_context=128,
                                  max_concurrency=2 * kv_mesh.data, policy=ExplicitCapacity(256 * kv_mesh.data))
        store = ShardedKVStore(plan, kv_mesh)
        state = allocate_state(store)
        work = store.take_work().pad_to(4, 8, 1).device_put(kv_mesh)
        lay = store.layout()
        b = 2 * kv_mesh.data
        for impl in ("ffi", "reference"):
            def step(state, work, rows, pos, q, k, v):
                state = sharded_apply_work(kv_mesh, state, work)
                ones = jnp.ones_like(pos)
                state = sharded_paged_append(kv_mesh, state, 1, lay, rows, pos, k, v, ones, impl=impl)
                return state, sharded_paged_attention(kv_mesh, q, state, 1, lay, rows, pos, pos + 1, impl=impl)

            i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
            tok = lambda h: jax.ShapeDtypeStruct((b, 1, h, D_HEAD), jnp.float32)  # noqa: E731
            text = jax.jit(step, donate_argnums=0).lower(state, work, i32, i32, tok(16), tok(8), tok(8)).compile().as_text()
            for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
                if op in text:
                    raise AssertionError(f"{spec} {impl}: the compiled sharded step contains {op}")
            if impl == "ffi":  # every FFI call sees one device's block of the planes
                calls = [ln for ln in text.splitlines() if "custom-call(" in ln]
                n_loc = plan.shard.pools[PoolKind.MAIN].physical_pages
                local = f"[2,{n_loc},{8 // kv_mesh.model},64,"
                glob = f"[2,{n_loc * kv_mesh.data},8,64,"
                if not any(local in ln for ln in calls) or any(glob in ln for ln in calls):
                    raise AssertionError(f"{spec}: the FFI calls do not run on per-device blocks of the planes")
            n += 1
        # the check can fail: the same attention on the sharded planes *outside* shard_map gathers them
        glob = plan.shard.pools[PoolKind.MAIN].layout

        def unsharded(state, rows, pos, q):
            view = PagedKVBatchLayerView(state.planes[PoolKind.MAIN], state.tables[PoolKind.MAIN], 1, glob)
            return ops.paged_attention(q, view, rows, pos, pos + 1, impl="ffi")

        text = jax.jit(unsharded).lower(state, i32, i32, tok(16)).compile().as_text()
        if "all-gather" not in text and "all-to-all" not in text and "collective-permute" not in text:
            raise AssertionError(f"{spec}: an FFI call outside shard_map did not gather its sharded inputs")
    return n


def pallas_cuda_lowering() -> int:
    """The Pallas kernels cross-lower for CUDA inside shard_map (2x4 mesh of host devices)."""
    import functools

    import pallas_kernels as pk
    from ninfer_kv.ops import OpImpl, register_impl

    triton = functools.partial  # the kernels with interpret=False: the Triton lowering, not the interpreter
    register_impl("pallas-triton", lambda: OpImpl(
        "pallas-triton", triton(pk.paged_append, interpret=False), triton(pk.paged_attention, interpret=False),
        triton(pk.cyclic_append, interpret=False), triton(pk.cyclic_attention, interpret=False)), replace=True)
    kv_mesh = KVMesh("data=2,model=4")
    n = 0
    for profile in ("bf16", "k8v4"):
        lay_local = PagedKVStorageLayout(profile, 1, 1, D_HEAD)
        lay_stored = PagedKVStorageLayout(profile, 1, 4, D_HEAD)
        planes = {k: jax.ShapeDtypeStruct(s, lay_stored.plane_dtypes()[k]) for k, s in lay_stored.plane_shapes(8).items()}
        kind = PoolKind.MAIN
        state = KVDeviceState({kind: planes}, {kind: jax.ShapeDtypeStruct((4, 2), jnp.int32)},
                              jax.ShapeDtypeStruct((), jnp.int32), ((kind, lay_stored),))

        def step(state, rows, pos, q, k):
            state = sharded_paged_append(kv_mesh, state, 0, lay_local, rows, pos, k, k, pos + 1, impl="pallas-triton")
            return sharded_paged_attention(kv_mesh, q, state, 0, lay_local, rows, pos, pos + 1, impl="pallas-triton")

        i32 = jax.ShapeDtypeStruct((4,), jnp.int32)
        tok = lambda h: jax.ShapeDtypeStruct((4, 1, h, D_HEAD), jnp.bfloat16)  # noqa: E731
        shardings = kv_mesh.state_shardings(state)
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)
        text = jax.jit(step).trace(state, i32, i32, tok(8), tok(4)).lower(lowering_platforms=("cuda",)).as_text()
        if text.count("__gpu$xla.gpu.triton") < 2:
            raise AssertionError(f"{profile}: the CUDA lowering lacks the Triton append and attention kernels")
        if "manual" not in text:
            raise AssertionError(f"{profile}: the CUDA lowering is not a shard_map (manual) program")
        n += 1
    return n


def store_verbs() -> int:
    """ShardedKVStore through the verbs on 2x4 and 8x1: per-shard invariants, shard-local page IDs,
    refusal of a cross-shard activation (nothing changes), sharded work applied per shard equals
    each shard's own single-device work."""
    n = 0
    for spec in ("data=2,model=4", "data=8,model=1"):
        kv_mesh = KVMesh(spec)
        dd = kv_mesh.data
        plan = plan_kv_cache_mesh(ModelKVConfig(1, 4, D_HEAD, "int8-g64"), kv_mesh, max_context=256,
                                  max_concurrency=2 * dd, policy=ExplicitCapacity(512 * dd))
        store = ShardedKVStore(plan, kv_mesh)
        state = allocate_state(store, fill=float("nan"))
        twins = [KVStore(plan.shard) for _ in range(dd)]  # one device per shard, same calls
        twin_states = [allocate_state(t, fill=float("nan")) for t in twins]
        seqs = []
        for d in range(dd):
            h = store.activate(100, 20, shard=d)
            seqs.append(h)
            twins[d].activate(100, 20)
        rows = np.array([store.row(h) for h in seqs], np.int64)
        assert sorted(set((rows // store.rows_per_shard).tolist())) == list(range(dd))
        store.map(rows, np.full(dd, 100))
        store.commit(rows, np.full(dd, 100))
        for d in range(dd):
            r = np.array([twins[d].row(twins[d].sequences()[0])])
            twins[d].map(r, [100])
            twins[d].commit(r, [100])
        ck = store.finish(seqs[0], retain=True)
        tck = twins[0].finish(twins[0].sequences()[0], retain=True)
        if dd > 1:
            before = store.snapshot()
            try:
                store.activate(100, 10, shard=1, source=ck)
            except CrossShardError:
                pass
            else:
                raise AssertionError("a cross-shard activation was accepted")
            assert _deep_equal(store.snapshot(), before), "a refused cross-shard activation changed the store"
        # atomic activation: a failure at any stage on any shard leaves every shard as it was
        armed = {}

        def inject(stage, pool, armed=armed):
            if armed.get("stage") == stage:
                raise RuntimeError(f"injected at {stage}")

        for sh in store.shards:
            sh.fault_injector = inject
        for stage in ("reserve", "private_tail", "publish_tables", "publish_active"):
            before = store.snapshot()
            armed["stage"] = stage
            try:
                store.activate(100, 10, shard=0, source=ck)
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"the fault at {stage} did not fire")
            armed.clear()
            assert _deep_equal(store.snapshot(), before), f"a failed activation at {stage} changed the store"
        fork = store.activate(100, 10, shard=0, source=ck)  # COW of the 36-token tail within shard 0
        twins[0].activate(100, 10, source=tck)
        store.audit_invariants()
        state, work = take_step_work(store, state, (4, 0, 0))  # the fork's COW copy is applied alone first
        assert work.counts()[PoolKind.MAIN] == (4, 0, 0)
        for d in range(dd):  # every shard's page IDs are its own: 0 .. N_local - 1
            tab = store.host_block_table()[d * store.rows_per_shard:(d + 1) * store.rows_per_shard]
            used = tab[tab < plan.shard.pools[PoolKind.MAIN].physical_pages]
            assert used.size and used.max() < plan.shard.pools[PoolKind.MAIN].physical_pages
        state = jax.jit(lambda s, w: sharded_apply_work(kv_mesh, s, w))(state, work)
        store.require_synced(state)
        for d in range(dd):
            tw = twins[d].take_work()
            twin_states[d] = apply_work_jit(twin_states[d], tw)
            got = np.asarray(state.tables[PoolKind.MAIN])[d * store.rows_per_shard:(d + 1) * store.rows_per_shard]
            _same(got, twin_states[d].tables[PoolKind.MAIN], f"{spec} shard {d} table")
            for name, plane in state.planes[PoolKind.MAIN].items():
                n_loc = plane.shape[1] // dd
                _same(np.asarray(plane)[:, d * n_loc:(d + 1) * n_loc], twin_states[d].planes[PoolKind.MAIN][name],
                      f"{spec} shard {d} plane {name}")
        # decode verbs over global rows of every shard: round boundary, map, settle (trim the rejected tail)
        live = [fork] + seqs[1:]
        grows = np.array([store.row(h) for h in live])
        grant = store.round_boundary(grows, step_tokens=4)
        assert np.array_equal(grant.rows, grows) and not grant.length_limited.any()
        store.map(grows, np.full(len(live), 104))
        store.settle(grows, np.full(len(live), 101), np.full(len(live), 101))
        store.audit_invariants()
        if dd > 1:  # the last shard's part is refused: the whole call is, no shard changed
            for verb, vals in (("map", [110] * (len(live) - 1) + [10**6]),
                               ("commit", [101] * (len(live) - 1) + [10**6]),
                               ("settle", [101] * (len(live) - 1) + [50])):
                before = store.snapshot()
                try:
                    getattr(store, verb)(grows, np.array(vals))
                except (ValueError, KVStoreError):
                    pass
                else:
                    raise AssertionError(f"{verb} accepted a bad value on the last shard")
                assert _deep_equal(store.snapshot(), before), f"a refused {verb} changed a shard"
        try:
            store.map(np.array([grows[0], grows[0]]), [105, 105])  # a row twice: nothing changes anywhere
        except ValueError:
            pass
        else:
            raise AssertionError("a duplicated row was accepted")
        store.audit_invariants()
        store.finish(fork)
        store.release_checkpoint(ck)
        for h in seqs[1:]:
            store.finish(h)
        store.audit_invariants()
        n += 1
    return n


def host_tier() -> int:
    """2x4: a checkpoint on shard 1 offloaded (each device gathers its own pages and heads), its
    Device replica dropped, reactivated on shard 1 (restored from the Host arena through the next
    work): the restored pages equal the originals bit for bit; a Host-memory copy of the state has
    the same specs in ``pinned_host`` memory."""
    kv_mesh = KVMesh("data=2,model=4")
    plan = plan_kv_cache_mesh(ModelKVConfig(1, 4, D_HEAD, "k8v4"), kv_mesh, max_context=256, max_concurrency=4,
                              policy=ExplicitCapacity(1024))
    store = ShardedKVStore(plan, kv_mesh, host_bytes=1 << 20)
    state = allocate_state(store, fill=float("nan"))
    host_copy = allocate_state(ShardedKVStore(plan, kv_mesh), memory_kind="pinned_host")
    for x, y in zip(jax.tree.leaves(host_copy), jax.tree.leaves(state)):
        assert x.sharding.memory_kind == "pinned_host" and x.sharding.spec == y.sharding.spec
    del host_copy
    lay = store.layout()
    h = store.activate(100, 0, shard=1)
    rows = store.batch_rows([[], [h]], 1)
    store.map(rows[1:], [100])
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 100, 4, D_HEAD)).astype(np.float32)
    step = jax.jit(lambda s, w, r, kk: sharded_paged_append(
        kv_mesh, sharded_apply_work(kv_mesh, s, w), 0, lay, r, jnp.zeros(2, jnp.int32), kk, kk,
        jnp.where(r < store.max_concurrency, 100, 0).astype(jnp.int32), impl="ffi"))
    state = step(state, store.take_work().pad_to(8).device_put(kv_mesh), rows, k)
    store.commit(rows[1:], [100])
    old_ids = store.host_block_table()[rows[1], :2]
    n_loc = plan.shard.pools[PoolKind.MAIN].physical_pages
    before = {n: np.asarray(x)[:, n_loc + old_ids] for n, x in state.planes[PoolKind.MAIN].items()}
    ck = store.finish(h, retain=True)
    report = offload_checkpoint(store, ck, state)
    assert store.drop_device_replica(ck) == 2, report
    assert store.checkpoint(ck).placement == "host"
    # one compilation whatever the page IDs: a second sequence on the other shard, same shapes
    h_other = store.activate(100, 0, shard=0)
    rows0 = store.batch_rows([[h_other], []], 1)
    store.map(rows0[:1], [100])
    state = step(state, store.take_work().pad_to(8).device_put(kv_mesh), rows0, k)
    store.commit(rows0[:1], [100])
    assert step._cache_size() == 1, "the sharded step recompiled for other page IDs"
    store.finish(h_other)
    h2 = store.activate(100, 0, shard=1, source=ck, release_source=True)
    work = store.take_work()
    assert work.counts()[PoolKind.MAIN][2] >= 2  # the two pages come back as restores
    state = jax.jit(lambda s, w: sharded_apply_work(kv_mesh, s, w))(state, work.device_put(kv_mesh))
    store.require_synced(state)
    new_ids = store.host_block_table()[store.row(h2), :2]
    for n, x in state.planes[PoolKind.MAIN].items():
        _same(np.asarray(x)[:, n_loc + new_ids], before[n], f"restored plane {n}")
    store.finish(h2)
    store.audit_invariants()
    return 1


def _refused(call, error, words: str, what: str) -> None:
    """``call()`` raises ``error`` with ``words`` in its message, else ``AssertionError(what)``."""
    try:
        call()
    except error as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(what)


def resync_sharded() -> int:
    """2x4: a skipped work poisons the sharded state (every shard's tables become sentinels, the
    step's appends are dropped on every device), ``resync`` repairs it per shard and quarantines only
    the sequence that committed after the slip; a blank state allocated later is refused until
    resynced."""
    from ninfer_kv.schema.geometry import SENTINEL_PAGE
    from ninfer_kv.schema.errors import LostContentError
    from ninfer_kv.device import resync
    from ninfer_kv.schema.errors import WorkOrderError

    kv_mesh = KVMesh("data=2,model=4")
    plan = plan_kv_cache_mesh(ModelKVConfig(1, 4, D_HEAD, "bf16"), kv_mesh, max_context=256, max_concurrency=4,
                              policy=ExplicitCapacity(1024))
    store = ShardedKVStore(plan, kv_mesh)
    state = allocate_state(store, fill=float("nan"))
    lay = store.layout()
    a, b = store.activate(64, 0, shard=0), store.activate(64, 64, shard=1)
    rows = store.batch_rows([[a], [b]], 1)
    store.map(rows, [64, 64])
    k = np.random.default_rng(5).standard_normal((2, 64, 4, D_HEAD)).astype(np.float32)
    step = jax.jit(lambda s, w, r, kk, pos, n: sharded_paged_append(
        kv_mesh, sharded_apply_work(kv_mesh, s, w), 0, lay, r, pos, kk, kk, n, impl="ffi"))
    state = step(state, store.take_work().pad_to(8).device_put(kv_mesh), rows, k, jnp.zeros(2, jnp.int32),
                 jnp.full(2, 64, jnp.int32))
    store.commit(rows, [64, 64])
    store.require_synced(state)
    good = {n: np.asarray(x).copy() for n, x in state.planes[PoolKind.MAIN].items()}
    store.map(rows[1:], [72])
    store.take_work()  # skipped
    state = step(state, store.take_work().pad_to(8).device_put(kv_mesh), rows, k, jnp.array([64, 64], jnp.int32),
                 jnp.array([0, 8], jnp.int32))
    store.commit(rows[1:], [72])  # the caller does not know its tokens were dropped
    assert (np.asarray(state.tables[PoolKind.MAIN]) == SENTINEL_PAGE).all(), "a poisoned shard kept its tables"
    for n, x in state.planes[PoolKind.MAIN].items():
        _same(x, good[n], f"plane {n} after a poisoned step")
    _refused(lambda: store.require_synced(state), WorkOrderError, "skipped", "a poisoned sharded state passed require_synced")
    state, report = resync(store, state)
    store.require_synced(state)
    store.audit_invariants()
    assert set(report.lost_sequences) == {b} and report.lost_sequences[b][PoolKind.MAIN] == 64, report
    assert set(store.lost()) == {b}
    table = np.asarray(state.tables[PoolKind.MAIN])
    assert np.array_equal(table, store.host_block_table()) and (table[rows[1]] == SENTINEL_PAGE).all()
    _refused(lambda: store.commit(b, 72), LostContentError, "quarantined", "a quarantined sequence accepted a commit")
    store.truncate(b, 64)
    assert store.lost() == {} and (store.host_block_table()[rows[1], :1] >= 0).all()
    blank = allocate_state(store)
    _refused(lambda: store.require_synced(blank), WorkOrderError, "blank", "a blank sharded state passed require_synced")
    store.finish(a)
    store.finish(b)
    store.audit_invariants()
    return 1


FAST = ("bf16", "k8v4")
CHECKS = {
    # default run: every profile once through the FFI on 2x4 (both axes sharded), the plane orders
    # alternating; the one-axis meshes and replicated heads with BF16 and K8V4 (each in both orders over
    # the meshes), the reference with K8V4 (every profile in both orders on every mesh: ops_all)
    "ops_fast": lambda: (ops_equal("data=2,model=4", 4, ("ffi",), one_order=True)
                         + ops_equal("data=8,model=1", 2, ("ffi",), FAST, one_order=True)
                         + ops_equal("data=1,model=8", 8, ("ffi",), FAST[::-1], one_order=True)
                         + ops_equal("data=2,model=4", 2, ("ffi",), FAST, one_order=True)
                         + ops_equal("data=2,model=4", 4, ("reference",), ("k8v4",), one_order=True)),
    # slow: every profile, order, implementation and mesh
    "ops_all": lambda: sum(ops_equal(m, h, ("reference", "ffi")) for m, h in
                           (("data=8,model=1", 2), ("data=1,model=8", 8), ("data=2,model=4", 4), ("data=2,model=4", 2))),
    "hlo": hlo_no_collectives,
    "pallas_cuda": pallas_cuda_lowering,
    "store": store_verbs,
    "host": host_tier,
    "resync": resync_sharded,
}


if __name__ == "__main__":
    import traceback

    failed = False
    for name in sys.argv[1:]:  # several checks share one JAX start; each reports on its own
        try:
            print(f"{name}: {CHECKS[name]()} checks passed", flush=True)
        except Exception:  # noqa: BLE001 - reported, and the exit status says so
            failed = True
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    sys.exit(1 if failed else 0)
