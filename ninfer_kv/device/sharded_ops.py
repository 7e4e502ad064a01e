"""KV ops over a device mesh: every op runs per shard inside ``shard_map``.

Each function wraps the single-device op (:func:`~ninfer_kv.apply_work`, :func:`ops.paged_append`,
:func:`ops.paged_attention`, any implementation: reference, FFI, Pallas) in ``jax.shard_map``
over the :class:`~ninfer_kv.device.mesh.KVMesh`: a device sees only its data shard's pages and rows and
its model shard's heads, so no plane is ever gathered or reduced across devices (a sharded
custom call outside ``shard_map`` would have its inputs all-gathered first).

Batch layout: a step's batch of ``B = D * B_local`` rows is split over the data axis in blocks;
batch slot ``i`` runs on data shard ``i // B_local`` and must carry a global row of that shard
(``shard * C_local + local row``; :meth:`ShardedKVStore.batch_rows`).  A row of another shard or
the padding row ``C`` is out of range on the device and inert (no write, zero output).  Queries
``(B, T, Hq, D)`` are split over the model axis on ``Hq`` (``Hq`` a multiple of ``T``); keys and
values ``(B, T, H, D)`` on ``H``, after repeating each head ``T / H`` times when heads are
replicated (``H < T``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .. import ops
from ..schema.kinds import PoolKind
from ..ops.views import PagedKVBatchLayerView
from ..schema.round_work import RoundWork, ShardedRoundWork
from .mesh import KVMesh
from .state import KVDeviceState
from .work import apply_work

__all__ = ["sharded_apply_work", "sharded_gather_pages", "sharded_paged_append", "sharded_paged_attention", "local_rows"]


def _shard_map(kv_mesh: KVMesh, fn, in_specs, out_specs, *, kernels: bool = False):
    # kernels=True: the body may call Pallas kernels or custom calls (the CPU lowering of
    # apply_work), whose output shapes carry no varying-axes annotation; the specs still say
    # exactly how every output is split
    return jax.shard_map(fn, mesh=kv_mesh.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=not kernels)


def local_rows(kv_mesh: KVMesh, rows: jax.Array, rows_per_shard: int) -> jax.Array:
    """Inside ``shard_map``: global rows -> this data shard's local rows (others out of range)."""
    return rows - kv_mesh.data_index().astype(rows.dtype) * rows_per_shard


def _rows_per_shard(state: KVDeviceState, kind: PoolKind, kv_mesh: KVMesh) -> int:
    return state.tables[kind].shape[0] // kv_mesh.data


def sharded_apply_work(kv_mesh: KVMesh, state: KVDeviceState, work: ShardedRoundWork) -> KVDeviceState:
    """Apply a :class:`ShardedRoundWork` to a sharded state: each data shard applies its own part
    (table rows, COW copies, Host restores) to its own pages, per device, inside ``shard_map``."""
    if not isinstance(work, ShardedRoundWork):
        raise TypeError(f"work must be a ShardedRoundWork, got {type(work).__name__}")
    if state.work_pending:  # the work is applied here: the mark is cleared
        state = state.replace(work_pending=False)
    state_specs = kv_mesh.state_specs(state)
    leaves, treedef = jax.tree_util.tree_flatten(work)
    leaf_specs = work.leaf_specs(kv_mesh)

    def local(st, leaves):
        wk = treedef.unflatten([x if x.ndim == 0 else x[0] for x in leaves])
        return apply_work(st, RoundWork.from_stamp(jnp.stack([wk.serial, wk.store]), wk.pools))

    return _shard_map(kv_mesh, local, (state_specs, leaf_specs), state_specs, kernels=True)(state, leaves)


def _repeat_heads(x: jax.Array, stored: int) -> jax.Array:
    heads = x.shape[2]
    return x if heads == stored else jnp.repeat(x, stored // heads, axis=2)


def _batch_spec(kv_mesh: KVMesh, heads: bool):
    return PartitionSpec(kv_mesh.data_axis, None, kv_mesh.model_axis, None) if heads else PartitionSpec(kv_mesh.data_axis)


def sharded_paged_append(
    kv_mesh: KVMesh,
    state: KVDeviceState,
    layer,
    layout,
    table_rows: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    *,
    pool="main",
    impl: str = "auto",
) -> KVDeviceState:
    """:func:`ops.paged_append` of one layer, per shard; returns the state with the new planes.

    ``layout`` is the per-device layout (``ShardedKVStore.layout(pool)``); ``table_rows`` global
    rows ``(B,)``; ``k, v (B, T, H, D)`` with the model's ``H`` heads (repeated here when the mesh
    replicates heads)."""
    kind = PoolKind.parse(pool)
    planes = state.planes[kind]
    stored = next(iter(planes.values())).shape[1 + (state.page_axis(kind) == 1)]
    k, v = _repeat_heads(jnp.asarray(k), stored), _repeat_heads(jnp.asarray(v), stored)
    plane_specs = kv_mesh.state_specs(state).planes[kind]
    c_local = _rows_per_shard(state, kind, kv_mesh)
    rows_spec = _batch_spec(kv_mesh, False)
    kv_spec = _batch_spec(kv_mesh, True)

    def local(planes, table, layer, rows, pos, k, v, valid):
        view = PagedKVBatchLayerView(planes, table, layer, layout)
        view = ops.paged_append(view, local_rows(kv_mesh, rows, c_local), pos, k, v, valid, impl=impl)
        return view.planes

    fn = _shard_map(
        kv_mesh, local,
        (plane_specs, kv_mesh.table_spec(), PartitionSpec(), rows_spec, rows_spec, kv_spec, kv_spec, rows_spec),
        plane_specs, kernels=True,
    )
    new = fn(planes, state.tables[kind], jnp.asarray(layer, jnp.int32), jnp.asarray(table_rows, jnp.int32),
             jnp.asarray(positions, jnp.int32), k, v, jnp.asarray(valid, jnp.int32))
    return state.replace(planes={**state.planes, kind: new})


def sharded_paged_attention(
    kv_mesh: KVMesh,
    q: jax.Array,
    state: KVDeviceState,
    layer,
    layout,
    table_rows: jax.Array,
    positions: jax.Array,
    kv_lens: jax.Array,
    *,
    pool="main",
    sm_scale: float | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    impl: str = "auto",
) -> jax.Array:
    """:func:`ops.paged_attention` of one layer, per shard: ``q (B, T, Hq, D)`` split over data
    (batch) and model (query heads), ``sinks (Hq,)`` over model; returns ``(B, T, Hq, D)`` with the
    same sharding.  ``window``, ``soft_cap``: as :func:`ops.paged_attention`."""
    kind = PoolKind.parse(pool)
    plane_specs = kv_mesh.state_specs(state).planes[kind]
    c_local = _rows_per_shard(state, kind, kv_mesh)
    rows_spec = _batch_spec(kv_mesh, False)
    q_spec = _batch_spec(kv_mesh, True)
    q = jnp.asarray(q)
    if q.shape[2] % kv_mesh.model:
        raise ValueError(f"q has {q.shape[2]} heads; they must split over the model axis of size {kv_mesh.model}")

    extra = () if sinks is None else (jnp.asarray(sinks, jnp.float32),)  # full attention: no sinks operand

    def local(planes, table, layer, q, rows, pos, lens, *sinks):
        view = PagedKVBatchLayerView(planes, table, layer, layout)
        return ops.paged_attention(q, view, local_rows(kv_mesh, rows, c_local), pos, lens, sm_scale=sm_scale,
                                   window=window, soft_cap=soft_cap, sinks=sinks[0] if sinks else None, impl=impl)

    fn = _shard_map(
        kv_mesh, local,
        (plane_specs, kv_mesh.table_spec(), PartitionSpec(), q_spec, rows_spec, rows_spec, rows_spec)
        + (PartitionSpec(kv_mesh.model_axis),) * len(extra),
        q_spec, kernels=True,
    )
    return fn(state.planes[kind], state.tables[kind], jnp.asarray(layer, jnp.int32), q,
              jnp.asarray(table_rows, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
              *extra)


def sharded_gather_pages(kv_mesh: KVMesh, state: KVDeviceState, pages: dict) -> tuple[jax.Array, dict]:
    """Per-shard :func:`~ninfer_kv.device.work.gather_pages`: ``pages = {PoolKind: int32 (D, B)}`` (row ``d``:
    shard ``d``'s local page IDs).  Returns ``(serial, {PoolKind: {plane: words (D, B, layers, H, P, X)}})``
    split like the planes (data on axis 0, heads on axis 3): each device gathers its own pages."""
    from .work import gather_pages

    state_specs = kv_mesh.state_specs(state)
    kinds = tuple(PoolKind.parse(k) for k in pages)
    ids = [jnp.asarray(pages[k], jnp.int32) for k in pages]
    word_spec = kv_mesh.per_shard_spec(head_axis=3, ndim=6)
    out_specs = {k: {n: word_spec for n in state.planes[k]} for k in kinds}

    def local(st, ids):
        _, out = gather_pages(st, {k: x[0] for k, x in zip(kinds, ids)})
        return {k: {n: x[None] for n, x in p.items()} for k, p in out.items()}

    fn = _shard_map(kv_mesh, local, (state_specs, [kv_mesh.per_shard_spec(ndim=2)] * len(ids)), out_specs)
    return state.serial, fn(state, ids)
