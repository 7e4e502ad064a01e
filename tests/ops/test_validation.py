"""Host-side validation at the op boundary: each bad input is rejected with a message naming it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import PagedKVStorageLayout, ops
from ninfer_kv.ops import validation
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

H, D, C, L, N, B, T = 2, 64, 3, 2, 6, 2, 3
CAP = L * 64
LAYOUT = PagedKVStorageLayout("nvfp4-g16", num_layers=2, num_kv_heads=H, head_dim=D)
CYC = CyclicKVLayout("bf16", num_layers=2, rows=4, num_kv_heads=H, head_dim=D, window=8, slots=10)


def i32(*v):
    return jnp.asarray(v, jnp.int32)


def _paged():
    view = PagedKVBatchLayerView(LAYOUT.allocate(N), jnp.zeros((C, L), jnp.int32), 1, LAYOUT)
    kv = jnp.zeros((B, T, H, D), jnp.float32)
    return dict(view=view, table_rows=i32(0, 2), positions=i32(0, 5), k=kv, v=kv, valid=i32(3, 1))


def _attn():
    a = _paged()
    return dict(q=jnp.zeros((B, T, 4 * H, D), jnp.bfloat16), view=a["view"], table_rows=a["table_rows"],
                positions=a["positions"], kv_lens=i32(3, CAP))


def _cyc_append():
    view = CyclicKVCacheLayerView(CYC.allocate(), 0, CYC)
    kv = jnp.zeros((B, T, H, D), jnp.bfloat16)
    return dict(view=view, rows=i32(3, 0), positions=i32(0, 100), k=kv, v=kv, valid=i32(3, 0))


def _cyc_attn():
    a = _cyc_append()
    return dict(q=jnp.zeros((B, T, H, D), jnp.float32), view=a["view"], rows=a["rows"], positions=a["positions"],
                kv_lens=i32(3, 50))


def _call(op, args, **kw):
    if op is ops.paged_append or op is ops.cyclic_append:
        keys = ["view", "table_rows" if "table_rows" in args else "rows", "positions", "k", "v", "valid"]
    else:
        keys = ["q", "view", "table_rows" if "table_rows" in args else "rows", "positions", "kv_lens"]
    return op(*[args[k] for k in keys], impl="reference", **kw)


def test_valid_inputs_pass():
    """Concrete, valid inputs pass every check, value checks included."""
    a, t, c, ct = _paged(), _attn(), _cyc_append(), _cyc_attn()
    validation.check_paged_append(a["view"], a["table_rows"], a["positions"], a["k"], a["v"], a["valid"])
    validation.check_paged_attention(t["q"], t["view"], t["table_rows"], t["positions"], t["kv_lens"], 0.5)
    validation.check_cyclic_append(c["view"], c["rows"], c["positions"], c["k"], c["v"], c["valid"])
    validation.check_cyclic_attention(ct["q"], ct["view"], ct["rows"], ct["positions"], ct["kv_lens"])


PAGED_APPEND_BAD = [
    ("table_rows", i32(0, 3), r"table_rows\[1\]=3 is out of range; allowed: \[0, C=3\)"),
    ("table_rows", i32(-1, 0), r"table_rows\[0\]=-1 is out of range"),
    ("positions", i32(0, -4), r"positions\[1\]=-4 is out of range; allowed: >= 0"),
    ("valid", i32(4, 0), r"valid\[0\]=4 is out of range; allowed: \[0, T=3\]"),
    ("valid", i32(0, -1), r"valid\[1\]=-1 is out of range"),
    ("positions", i32(CAP - 2, 0), r"positions\[0\] \+ valid\[0\] = 126 \+ 3 = 129 exceeds the logical capacity L\*P = 2\*64 = 128"),
    ("table_rows", jnp.zeros((B,), jnp.int64) if jax.config.jax_enable_x64 else np.zeros((B,), np.int64), "table_rows must be int32, got int64"),
    ("positions", i32(0, 0, 0), r"positions must have shape \(B,\) = \(2,\), got \(3,\)"),
    ("valid", [3, 1], "valid must be an array, got list"),
    ("k", jnp.zeros((B, T, H, D), jnp.float16), "k has dtype float16; allowed: float32 or bfloat16"),
    ("k", jnp.zeros((B, T, H, D)[1:], jnp.float32), r"k must be \(B, T, H, D\), got shape \(3, 2, 64\)"),
    ("v", jnp.zeros((B, T, H, D), jnp.bfloat16), "k and v dtypes differ: float32 vs bfloat16"),
    ("v", jnp.zeros((B, T + 1, H, D), jnp.float32), r"k and v shapes differ: \(2, 3, 2, 64\) vs \(2, 4, 2, 64\)"),
    ("view", "planes", "view must be a PagedKVBatchLayerView"),
]


@pytest.mark.parametrize("name,value,message", PAGED_APPEND_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(PAGED_APPEND_BAD)])
def test_paged_append_rejects(name, value, message):
    args = _paged()
    args[name] = value
    with pytest.raises((ValueError, TypeError), match=message):
        _call(ops.paged_append, args)


def test_paged_append_shape_errors_name_the_layout():
    for kv, message in [
        (jnp.zeros((B, T, H + 1, D), jnp.float32), "k has H=3 heads; the view's layout has num_kv_heads=2"),
        (jnp.zeros((B, T, H, 32), jnp.float32), "k has head dim D=32; the view's layout has head_dim=64"),
        (jnp.zeros((B, 0, H, D), jnp.float32), "k has T=0 tokens per row; T must be >= 1"),
    ]:
        args = _paged()
        args["k"] = args["v"] = kv
        with pytest.raises(ValueError, match=message):
            _call(ops.paged_append, args)


PAGED_ATTN_BAD = [
    ("q", jnp.zeros((B, T, 3, D), jnp.float32), "q has Hq=3 query heads, which is not a positive multiple of the H=2 KV heads"),
    ("q", jnp.zeros((B, T, H, 128), jnp.float32), "q has head dim D=128; the view's layout has head_dim=64"),
    ("q", jnp.zeros((B, T, H, D), jnp.int8), "q has dtype int8; allowed: float32 or bfloat16"),
    ("q", jnp.zeros((B, 0, H, D), jnp.float32), "q has T=0 queries per row; T must be >= 1"),
    ("kv_lens", i32(CAP + 1, 0), r"kv_lens\[0\]=129 is out of range; allowed: \[0, L\*P=128\]"),
    ("kv_lens", i32(0, -2), r"kv_lens\[1\]=-2 is out of range"),
    ("positions", i32(-7, 0), r"positions\[0\]=-7 is out of range"),
    ("table_rows", i32(0, 9), r"table_rows\[1\]=9 is out of range; allowed: \[0, C=3\)"),
    ("table_rows", i32(0), r"table_rows must have shape \(B,\) = \(2,\), got \(1,\)"),
]


@pytest.mark.parametrize("name,value,message", PAGED_ATTN_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(PAGED_ATTN_BAD)])
def test_paged_attention_rejects(name, value, message):
    args = _attn()
    args[name] = value
    with pytest.raises(ValueError, match=message):
        _call(ops.paged_attention, args)


@pytest.mark.parametrize("scale,exc,message", [
    (-1.0, ValueError, "sm_scale=-1.0 is invalid; it must be a finite number > 0"),
    (float("nan"), ValueError, "sm_scale=nan is invalid"),
    ("0.1", TypeError, "sm_scale must be None or a Python/numpy real number, got str"),
])
def test_sm_scale_rejected(scale, exc, message):
    with pytest.raises(exc, match=message):
        _call(ops.paged_attention, _attn(), sm_scale=scale)


def test_view_layer_and_planes_checked_at_the_op():
    args = _attn()
    view = args["view"]
    # a view rebuilt without validation (as tree_unflatten does) is still checked by the op
    args["view"] = PagedKVBatchLayerView(view.planes, view.block_tables, 7, LAYOUT, validate=False)
    with pytest.raises(ValueError, match=r"layer=7 is out of range \[0, 2\)"):
        _call(ops.paged_attention, args)
    planes = dict(view.planes, v=view.planes["v"][:, :, :1])
    args["view"] = PagedKVBatchLayerView(planes, view.block_tables, 0, LAYOUT, validate=False)
    with pytest.raises(ValueError, match="plane 'v' has shape"):
        _call(ops.paged_attention, args)


def test_single_sequence_view_needs_zero_table_rows():
    view = _paged()["view"]
    from ninfer_kv.views import PagedKVLayerView

    single = PagedKVLayerView(view.planes, view.block_tables[0], 0, LAYOUT)
    a = _attn()
    with pytest.raises(ValueError, match=r"table_rows\[1\]=2 is out of range; a PagedKVLayerView has one table row"):
        ops.paged_attention(a["q"], single, i32(0, 2), a["positions"], a["kv_lens"], impl="reference")


def test_cyclic_rejects():
    for name, value, message in [
        ("rows", i32(0, 4), r"rows\[1\]=4 is out of range; allowed: \[0, rows=4\)"),
        ("positions", i32(-1, 0), r"positions\[0\]=-1 is out of range"),
        ("valid", i32(0, 5), r"valid\[1\]=5 is out of range; allowed: \[0, T=3\]"),
    ]:
        args = _cyc_append()
        args[name] = value
        with pytest.raises(ValueError, match=message):
            _call(ops.cyclic_append, args)
    args = _cyc_attn()
    args["kv_lens"] = i32(0, -3)
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=-3 is out of range; allowed: >= 0"):
        _call(ops.cyclic_attention, args)
    args = _cyc_attn()
    args["q"] = jnp.zeros((B, 4, H, D), jnp.float32)
    with pytest.raises(ValueError, match="q has T=4 queries per row; a ring of slots=10 with window=8 holds the keys of at most T = slots - window \\+ 1 = 3"):
        _call(ops.cyclic_attention, args)
    args = _cyc_attn()
    args["view"] = _paged()["view"]
    with pytest.raises(TypeError, match="view must be a CyclicKVCacheLayerView, got PagedKVBatchLayerView"):
        _call(ops.cyclic_attention, args)


def test_under_jit_only_static_checks_run():
    args = _attn()
    bad_values = dict(args, positions=i32(-5, 0), kv_lens=i32(10_000, 0), table_rows=i32(0, 99))

    @jax.jit
    def attend(q, view, rows, pos, lens):
        return ops.paged_attention(q, view, rows, pos, lens, impl="reference")

    # value ranges are data under jit: not checked (the caller's host bookkeeping guarantees them)
    attend(bad_values["q"], bad_values["view"], bad_values["table_rows"], bad_values["positions"], bad_values["kv_lens"])
    # static properties are still checked while tracing
    with pytest.raises(ValueError, match="q has Hq=3 query heads"):
        attend(jnp.zeros((B, T, 3, D), jnp.float32), args["view"], args["table_rows"], args["positions"], args["kv_lens"])
    with pytest.raises(ValueError, match="kv_lens must be int32, got uint32"):
        attend(args["q"], args["view"], args["table_rows"], args["positions"], jnp.zeros((B,), jnp.uint32))


def test_failed_validation_changes_nothing():
    args = _paged()
    before = {k: np.asarray(v).copy() for k, v in args["view"].planes.items()}
    args["valid"] = i32(9, 9)
    with pytest.raises(ValueError):
        _call(ops.paged_append, args)
    for k, v in args["view"].planes.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])
