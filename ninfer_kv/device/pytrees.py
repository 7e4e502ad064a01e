"""The pytree structure of the data the store hands the device (:mod:`ninfer_kv.schema.round_work`).

Registered once, when the device layer is imported, so the store's numpy dataclasses pass through
``jax.jit``, ``shard_map`` and ``jax.tree_util`` as explicit pytrees: ``RoundWork(stamp, pools)``,
``PoolWork`` (its leaves are the non-empty arrays only: an empty bucket is part of the static
structure, so a decode round's work transfers its table updates and nothing else),
``ShardedRoundWork`` (every array a leaf, empty buckets included), ``GatherRequest`` and
``OffloadPayload``.
"""

from __future__ import annotations

import jax
import numpy as np

from ..schema.round_work import GatherRequest, OffloadPayload, PoolWork, RoundWork, ShardedRoundWork

__all__: list[str] = []


def _pool_work_flatten(pw: PoolWork):
    # Runs on every jitted call that takes a work (a decode round's hot path): plain attribute
    # reads and tuples only.  ``aux`` names each empty numpy bucket's shape and dtype (part of the
    # static structure, rebuilt by unflatten) and holds ``None`` for a leaf (any other object: a
    # non-empty array, a tracer, a spec).
    payload = pw.payload
    names = tuple(sorted(payload)) if payload else ()
    kids, spec = [], []
    for x in (pw.tables, pw.copies, pw.restores, *map(payload.__getitem__, names)):
        if type(x) is np.ndarray and not x.size:  # a leaf may be any object (a tracer, a spec)
            spec.append((x.shape, x.dtype))
        else:
            kids.append(x)
            spec.append(None)
    return kids, (pw.pad_row, pw.pad_page, names, tuple(spec))


def _pool_work_unflatten(aux, kids) -> PoolWork:
    pad_row, pad_page, names, spec = aux
    it = iter(kids)
    vals = [next(it) if empty is None else np.zeros(empty[0], empty[1]) for empty in spec]
    return PoolWork(vals[0], vals[1], vals[2], dict(zip(names, vals[3:])), pad_row, pad_page)


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
jax.tree_util.register_pytree_node(
    RoundWork, lambda w: ((w.stamp, w.pools), None), lambda _, kids: RoundWork.from_stamp(*kids)
)
jax.tree_util.register_dataclass(GatherRequest, data_fields=["pages", "store", "token"], meta_fields=[])
jax.tree_util.register_dataclass(
    OffloadPayload, data_fields=["store", "token", "serial", "pages", "planes"], meta_fields=[]
)
