"""What only the FFI handlers promise: operand checks on a direct ffi_call, and an append to a
traced layer outside ``[0, num_layers)`` that writes nothing (the op contract leaves both open)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.ops.ffi import kv as ffi_kv

from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.ops.views import PagedKVBatchLayerView
from tests.conformance.cases import append_case, append_geometry, random_kv, richest_profile
from tests.conformance.checks import assert_same_planes

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")


def test_paged_attention_handler_rejects_bad_operands():
    """Malformed operands reach the handler only through a direct ffi_call; it errors, not crashes."""
    call = jax.ffi.ffi_call("ninfer_kv_paged_attention", jax.ShapeDtypeStruct((2, 64), jnp.float32))
    planes = [jnp.zeros((1, 4, 2, 64, 64), jnp.bfloat16)] * 2
    i32 = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    with pytest.raises(Exception, match="q must be"):
        call(
            jnp.zeros((2, 64), jnp.float32), i32(1, 2), i32(), i32(1), i32(1), i32(1), *planes,
            k_codec=np.int32(0), v_codec=np.int32(0), head_major=np.int32(0), sm_scale=np.float32(1.0), no_splits=np.int32(0),
        ).block_until_ready()


def test_an_append_to_a_traced_layer_out_of_range_writes_nothing():
    """Layer num_layers + 3, traced: every byte of every plane (random-byte poison) comes back unchanged."""
    g = append_geometry(richest_profile())
    case = append_case(g, seed=5)
    view = case.view()
    far = PagedKVBatchLayerView(view.planes, view.block_tables, jnp.int32(case.layout.num_layers + 3), case.layout,
                                validate=False)
    k, v = random_kv(np.random.default_rng(6), (g.batch, g.t, g.heads, g.head_dim))
    rows, pos, valid = (jnp.asarray(x, jnp.int32) for x in (case.table_rows, [0, 10, 60, 100], [5, 5, 5, 5]))
    out = jax.jit(ffi_kv.paged_append)(far, rows, pos, jnp.asarray(k), jnp.asarray(v), valid)
    assert_same_planes({n: np.asarray(x) for n, x in out.planes.items()}, case.planes, "layer out of range")
