"""A jitted model-step slice (append, then attend, planes donated) and its abstract arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_kv import ops
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import PagedKVBatchLayerView


def decode_step(impl: str, layout: PagedKVStorageLayout):
    """``step(planes, tables, layer, rows, positions, k, v, valid, q, kv_lens) -> (planes, out)``
    under ``jax.jit`` with the planes donated (an in-place append)."""

    def step(planes, tables, layer, rows, positions, k, v, valid, q, kv_lens):
        view = PagedKVBatchLayerView(planes, tables, layer, layout)
        view = ops.paged_append(view, rows, positions, k, v, valid, impl=impl)
        return view.planes, ops.paged_attention(q, view, rows, positions, kv_lens, impl=impl)

    return jax.jit(step, donate_argnums=0)


def step_arg_specs(layout: PagedKVStorageLayout, *, batch, t, q_heads, rows, logical_pages, num_pages, dtype="bfloat16"):
    """``jax.ShapeDtypeStruct`` arguments of :func:`decode_step` (lower/compile without buffers)."""
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    planes = {n: s(shape, layout.plane_dtypes()[n]) for n, shape in layout.plane_shapes(num_pages).items()}
    h, d = layout.num_kv_heads, layout.head_dim
    kv = s((batch, t, h, d), dtype)
    vec = s((batch,), i32)
    return (planes, s((rows, logical_pages), i32), s((), i32), vec, vec, kv, kv, vec, s((batch, t, q_heads, d), dtype), vec)
