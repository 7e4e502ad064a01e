"""The pytree structure of the data the store hands the device (:mod:`ninfer_kv.work`).

Registered once, when the device layer is imported, so the store's numpy dataclasses pass through
``jax.jit``, ``shard_map`` and ``jax.tree_util`` as explicit pytrees: ``RoundWork(serial, pools,
store)``, ``PoolWork`` (its leaves are the non-empty arrays only: an empty bucket is part of the
static structure, so a decode round's work transfers its table updates and nothing else),
``ShardedRoundWork`` (every array a leaf, empty buckets included), ``GatherRequest`` and
``OffloadPayload``.
"""

from __future__ import annotations

import jax
import numpy as np

from ..work import GatherRequest, OffloadPayload, PoolWork, RoundWork, ShardedRoundWork

__all__: list[str] = []


def _empty(x) -> bool:
    """An empty numpy buffer: static structure, not a leaf (any other leaf object is kept)."""
    return isinstance(x, np.ndarray) and x.size == 0


def _pool_work_flatten(pw: PoolWork):
    arrays = [("tables", pw.tables), ("copies", pw.copies), ("restores", pw.restores)]
    arrays += [(f"payload/{n}", x) for n, x in sorted(pw.payload.items())]
    kids = [x for _, x in arrays if not _empty(x)]
    spec = tuple((name, (tuple(x.shape), x.dtype.str) if _empty(x) else None) for name, x in arrays)
    return kids, (pw.pad_row, pw.pad_page, spec)


def _pool_work_unflatten(aux, kids) -> PoolWork:
    pad_row, pad_page, spec = aux
    it = iter(kids)
    vals = {name: next(it) if empty is None else np.zeros(empty[0], np.dtype(empty[1])) for name, empty in spec}
    payload = {name[len("payload/") :]: v for name, v in vals.items() if name.startswith("payload/")}
    return PoolWork(vals["tables"], vals["copies"], vals["restores"], payload, pad_row, pad_page)


def _work_flatten(work: ShardedRoundWork):
    # every array is a leaf, empty buckets included (their shapes are static), so the leaves never
    # need inspecting: jit's argument records flatten through here too
    kids, aux = [work.serial, work.store], []
    for kind, pw in work.pools.items():
        names = tuple(sorted(pw.payload))
        kids += [pw.tables, pw.copies, pw.restores] + [pw.payload[n] for n in names]
        aux.append((kind, names, pw.pad_row, pw.pad_page))
    return kids, tuple(aux)


def _work_unflatten(aux, kids) -> ShardedRoundWork:
    it = iter(kids)
    serial, store = next(it), next(it)
    pools = {}
    for kind, names, pad_row, pad_page in aux:
        t, k, r = next(it), next(it), next(it)
        pools[kind] = PoolWork(t, k, r, {n: next(it) for n in names}, pad_row, pad_page)
    return ShardedRoundWork(serial, pools, store)


jax.tree_util.register_pytree_node(PoolWork, _pool_work_flatten, _pool_work_unflatten)
jax.tree_util.register_pytree_node(ShardedRoundWork, _work_flatten, _work_unflatten)
jax.tree_util.register_dataclass(RoundWork, data_fields=["serial", "pools", "store"], meta_fields=[])
jax.tree_util.register_dataclass(GatherRequest, data_fields=["pages", "store", "token"], meta_fields=[])
jax.tree_util.register_dataclass(
    OffloadPayload, data_fields=["store", "token", "serial", "pages", "planes"], meta_fields=[]
)
