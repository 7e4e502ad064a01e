"""A round work's table updates and page writes as C++ XLA FFI CPU kernels: the CPU lowering of
:func:`ninfer_kv.device.work.apply_work`, in place, without XLA's whole-plane copies."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...schema.layout import word_dtype
from .handlers import _i32, _require

__all__ = ["apply_tables", "write_pages"]


def apply_tables(sync, stamp, tables: Sequence, updates: Sequence) -> tuple[jax.Array, list[jax.Array]]:
    """One round work's block-table updates and order check, in place (CPU).

    ``sync``: the state's ``int32 (5,)`` order record; ``stamp``: the work's ``int32 (2,)``
    ``(serial, store)``; ``tables[i]``: ``int32 (C, L)`` block tables (donate them: they are the
    results' buffers); ``updates[i]``: ``int32 (3, U)`` ``(row, block, page)`` entries (an index
    outside its range, after one wrap of a negative one, is dropped).  Returns the new record and
    tables with exactly the semantics of :func:`ninfer_kv.device.work.apply_work`: applied when
    the work is next in order, else nothing applied, every entry the sentinel and the slip recorded.
    """
    _require()
    tables = [_i32(t) for t in tables]
    if len(tables) != len(updates):
        raise ValueError(f"{len(tables)} tables and {len(updates)} update lists")
    call = jax.ffi.ffi_call(
        "ninfer_kv_apply_tables",
        (jax.ShapeDtypeStruct((5,), jnp.int32),) + tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables),
        input_output_aliases={0: 0, **{2 + i: 1 + i for i in range(len(tables))}},
        vmap_method="sequential",
    )
    out = call(_i32(sync), _i32(stamp), *tables, *(_i32(u) for u in updates))
    return out[0], list(out[1:])


def write_pages(sync, stamp, planes: Mapping[str, jax.Array], copies, restores, payload: Mapping, *,
                page_axis: int) -> dict[str, jax.Array]:
    """One pool's page writes of a round work, in place (CPU): COW copies ``(src, dst, columns)``
    and Host restores ``(dst, columns)`` from ``payload[plane]`` words ``(R, layers, H, P, X)``.

    Written only when the work is next in order (``sync``, ``stamp`` as :func:`apply_tables`);
    every source is read before any destination is written; entries with ``columns == 0`` or a
    destination outside the pool write nothing.  ``planes`` are the results' buffers (donate
    them); ``page_axis`` 1 (page-major) or 2 (head-major).  The semantics of
    :func:`ninfer_kv.ops.page_copy.write_pages`, without its whole-plane copies on XLA's CPU
    compiler.
    """
    _require()
    names = list(planes)
    words = []
    for n in names:
        x = planes[n]
        if payload and n in payload:
            words.append(jnp.asarray(payload[n]))
        else:  # no restores: a zero-entry payload (0, layers, H, P, X) of the plane's word type
            heads = x.shape[2] if page_axis == 1 else x.shape[1]
            words.append(jnp.zeros((0, x.shape[0], heads, x.shape[3], x.shape[4]), word_dtype(x.dtype)))
    call = jax.ffi.ffi_call(
        "ninfer_kv_write_pages",
        tuple(jax.ShapeDtypeStruct(planes[n].shape, planes[n].dtype) for n in names),
        input_output_aliases={4 + i: i for i in range(len(names))},
        vmap_method="sequential",
    )
    out = call(_i32(sync), _i32(stamp), _i32(copies), _i32(restores), *(planes[n] for n in names), *words,
               page_axis=np.int64(page_axis))
    return dict(zip(names, out))
