"""The ragged (ragged) ops' host checks: each bad input is refused naming it and its allowed range."""

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops import validation
from ninfer_kv.ops.views import PagedKVBatchLayerView, allocate_planes

H, D, C, L, N = 2, 64, 3, 2, 6
CAP = L * 64
LAYOUT = PagedKVStorageLayout("int8", num_layers=2, num_kv_heads=H, head_dim=D)


def i32(*v):
    return jnp.asarray(v, jnp.int32)


def _view():
    tables = jnp.asarray(np.arange(C * L, dtype=np.int32).reshape(C, L) % N)
    return PagedKVBatchLayerView(allocate_planes(LAYOUT, N), tables, 1, LAYOUT)


def _append(**over):
    kv = jnp.zeros((7, H, D), jnp.float32)
    a = dict(view=_view(), table_rows=i32(0, 2), positions=i32(0, 5), k=kv, v=kv, query_starts=i32(0, 4, 7))
    a.update(over)
    return ops.paged_append_ragged(a["view"], a["table_rows"], a["positions"], a["k"], a["v"], a["query_starts"],
                                   impl="reference")


def _attention(**over):
    a = dict(q=jnp.zeros((7, 2 * H, D), jnp.bfloat16), view=_view(), table_rows=i32(0, 2), positions=i32(0, 5),
             kv_lens=i32(4, 8), query_starts=i32(0, 4, 7))
    a.update(over)
    return ops.paged_attention_ragged(a["q"], a["view"], a["table_rows"], a["positions"], a["kv_lens"],
                                      a["query_starts"], impl="reference")


def test_valid_ragged_calls_pass():
    """Concrete, valid inputs pass every check, value checks included (the op itself runs in tests/conformance)."""
    kv = jnp.zeros((7, H, D), jnp.float32)
    rows = validation.check_paged_append_ragged(_view(), i32(0, 2), i32(0, 5), kv, kv, i32(0, 4, 7))
    assert [tuple(x.shape) for x in rows] == [(2,), (2,), (3,)]
    q = jnp.zeros((7, 2 * H, D), jnp.bfloat16)
    rows = validation.check_paged_attention_ragged(q, _view(), i32(0, 2), i32(0, 5), i32(4, 8), i32(0, 4, 7), 0.5)
    assert [tuple(x.shape) for x in rows] == [(2,), (2,), (2,), (3,)]


@pytest.mark.parametrize("over, message", [
    (dict(query_starts=i32(0, 5, 4)), r"query_starts\[2\]=4 is below query_starts\[1\]=5; query_starts must be "
                                      r"non-decreasing"),
    (dict(query_starts=i32(0, 4, 8)), r"query_starts\[2\]=8 is out of range; allowed: \[0, N=7\]"),
    (dict(query_starts=i32(-1, 4, 7)), r"query_starts\[0\]=-1 is out of range"),
    (dict(query_starts=i32(0, 7)), r"query_starts must have shape \(B,\) = \(3,\)"),
    (dict(positions=i32(0, CAP - 2)), r"positions\[1\] \+ row length\[1\] = 126 \+ 3 = 129 exceeds the logical "
                                      r"capacity"),
    (dict(table_rows=i32(0, C)), r"table_rows\[1\]=3 is out of range; allowed: \[0, C=3\)"),
    (dict(k=jnp.zeros((1, 7, H, D))), r"k must be the tokens of a ragged batch \(N, H, D\)"),
    (dict(table_rows=jnp.zeros((0,), jnp.int32)), r"table_rows must be an integer vector \(R,\) with R >= 1 rows"),
])
def test_bad_ragged_appends_are_refused(over, message):
    with pytest.raises(ValueError, match=message):
        _append(**over)


@pytest.mark.parametrize("over, message", [
    (dict(kv_lens=i32(4, CAP + 1)), r"kv_lens\[1\]=129 is out of range; allowed: \[0, L\*P=128\]"),
    (dict(q=jnp.zeros((7, 3, D))), r"q has Hq=3 query heads, which is not a positive multiple of the H=2"),
    (dict(query_starts=i32(3, 2, 7)), r"query_starts\[1\]=2 is below query_starts\[0\]=3"),
    (dict(positions=i32(-1, 5)), r"positions\[0\]=-1 is out of range; allowed: >= 0"),
])
def test_bad_ragged_attention_is_refused(over, message):
    with pytest.raises(ValueError, match=message):
        _attention(**over)


def test_a_table_entry_the_writes_touch_must_be_a_page():
    view = _view()
    tables = np.asarray(view.block_tables).copy()
    tables[2, 1] = N  # row 2's second block: touched by a row writing 3 tokens from position 62
    bad = PagedKVBatchLayerView(view.planes, jnp.asarray(tables), 1, LAYOUT)
    with pytest.raises(ValueError, match=r"block_tables\[2, 1\] = 6 \(table row 2 = table_rows\[1\]"):
        _append(view=bad, positions=i32(0, 62))
