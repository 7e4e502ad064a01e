"""Host-side validation at the op boundary: each bad input is rejected with a message naming it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops import validation
from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView
from ninfer_kv.ops.views import allocate_planes

H, D, C, L, N, B, T = 2, 64, 3, 2, 6, 2, 3
CAP = L * 64
LAYOUT = PagedKVStorageLayout("nvfp4-g16", num_layers=2, num_kv_heads=H, head_dim=D)
CYC = CyclicKVLayout("bf16", num_layers=2, rows=4, num_kv_heads=H, head_dim=D, window=8, slots=10)


def i32(*v):
    return jnp.asarray(v, jnp.int32)


def _paged():
    view = PagedKVBatchLayerView(allocate_planes(LAYOUT, N), jnp.zeros((C, L), jnp.int32), 1, LAYOUT)
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
    ("table_rows", np.zeros((B,), np.float32), r"table_rows must hold integers \(any integer dtype\), got dtype float32"),
    ("table_rows", np.array([0, 2**31], np.int64), r"table_rows\[1\]=2147483648 does not fit in int32"),
    ("positions", i32(0, 0, 0), r"positions must have shape \(B,\) = \(2,\), got \(3,\)"),
    ("valid", [3.0, 1.0], "valid must hold integers"),
    ("valid", [True, False], "valid must hold integers .* got dtype bool"),
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
    from ninfer_kv.ops.views import PagedKVLayerView

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
    with pytest.raises(TypeError, match="kv_lens must hold integers .* got dtype float32"):
        attend(args["q"], args["view"], args["table_rows"], args["positions"], jnp.zeros((B,), jnp.float32))
    # any integer dtype is converted with astype inside the trace
    attend(args["q"], args["view"], args["table_rows"], args["positions"], jnp.zeros((B,), jnp.uint32))


def test_failed_validation_changes_nothing():
    args = _paged()
    before = {k: np.asarray(v).copy() for k, v in args["view"].planes.items()}
    args["valid"] = i32(9, 9)
    with pytest.raises(ValueError):
        _call(ops.paged_append, args)
    for k, v in args["view"].planes.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])


# -- integer-like index inputs ------------------------------------------------------------------


@pytest.mark.parametrize("convert", [
    lambda a: np.asarray(a, np.int64),
    lambda a: np.asarray(a, np.uint16),
    lambda a: [int(x) for x in a],
    lambda a: tuple(np.asarray(a, np.int16)),
    lambda a: jnp.asarray(a, jnp.int32),
], ids=["numpy-int64", "numpy-uint16", "list", "tuple-of-int16", "jax-int32"])
def test_index_vectors_accept_integer_array_likes(convert):
    a, t, c, ct = _paged(), _attn(), _cyc_append(), _cyc_attn()
    checks = [
        (validation.check_paged_append, (a["view"], convert([0, 2]), convert([0, 5]), a["k"], a["v"], convert([3, 1])), [[0, 2], [0, 5], [3, 1]]),
        (validation.check_paged_attention, (t["q"], t["view"], convert([0, 2]), convert([0, 5]), convert([3, CAP])), [[0, 2], [0, 5], [3, CAP]]),
        (validation.check_cyclic_append, (c["view"], convert([3, 0]), convert([0, 100]), c["k"], c["v"], convert([3, 0])), [[3, 0], [0, 100], [3, 0]]),
        (validation.check_cyclic_attention, (ct["q"], ct["view"], convert([3, 0]), convert([0, 100]), convert([3, 50])), [[3, 0], [0, 100], [3, 50]]),
    ]
    for check, args, want in checks:
        for got, w in zip(check(*args), want):
            assert isinstance(got, jax.Array) and got.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(got), w)


def test_ops_hand_int32_arrays_to_the_implementation():
    """Lists, tuples and numpy int64 reach the implementation as int32 jax arrays."""
    seen = []

    def record(*args, **kwargs):
        seen.append([x for x in args if isinstance(x, jax.Array) and x.ndim == 1])
        return args[0] if isinstance(args[0], PagedKVBatchLayerView) else jnp.zeros(())

    def loader():
        return ops.OpImpl("recording", record, record, record, record)

    t, a = _attn(), _paged()
    with ops.override_impls({"recording": loader}):
        ops.paged_attention(t["q"], t["view"], [0, 2], np.array([0, 5]), (3, CAP), impl="recording")
        ops.paged_append(a["view"], np.array([0, 2], np.uint8), [0, 5], a["k"], a["v"], np.array([3, 1], np.int64), impl="recording")
    assert [[list(np.asarray(x)) for x in call] for call in seen] == [[[0, 2], [0, 5], [3, CAP]], [[0, 2], [0, 5], [3, 1]]]
    assert all(x.dtype == jnp.int32 for call in seen for x in call)


def test_converted_vectors_are_int32():
    a = _paged()
    rows, pos, valid = validation.check_paged_append(a["view"], [0, 2], np.array([0, 5], np.int64), a["k"], a["v"], (3, 1))
    for x in (rows, pos, valid):
        assert isinstance(x, jax.Array) and x.dtype == jnp.int32


def test_index_overflow_and_dtype_errors_name_the_argument():
    t = _attn()
    with pytest.raises(ValueError, match=r"kv_lens\[0\]=-2147483649 does not fit in int32; allowed: \[-2147483648, 2147483647\]"):
        _call(ops.paged_attention, dict(t, kv_lens=np.array([-(2**31) - 1, 0], np.int64)))
    with pytest.raises(ValueError, match=r"positions\[1\]=18446744073709551615 does not fit in int32"):
        _call(ops.paged_attention, dict(t, positions=np.array([0, 2**64 - 1], np.uint64)))
    with pytest.raises(TypeError, match="table_rows must hold integers"):
        _call(ops.paged_attention, dict(t, table_rows=jnp.zeros((B,), jnp.bfloat16)))
    c = _cyc_append()
    with pytest.raises(TypeError, match="rows must hold integers"):
        _call(ops.cyclic_append, dict(c, rows=np.array([0.0, 1.0])))


def test_positions_whose_token_span_overflows_int32_are_rejected():
    t = _attn()
    with pytest.raises(ValueError, match=r"positions\[0\]=2147483647 is out of range; allowed: <= 2\*\*31 - T = 2147483645"):
        _call(ops.paged_attention, dict(t, positions=i32(2**31 - 1, 0)))
    c = _cyc_attn()
    with pytest.raises(ValueError, match=r"positions\[1\]=2147483646 is out of range"):
        _call(ops.cyclic_attention, dict(c, positions=i32(0, 2**31 - 2)))


# -- block-table entries -------------------------------------------------------------------------


def _with_tables(args, tables):
    view = args["view"]
    return dict(args, view=PagedKVBatchLayerView(view.planes, jnp.asarray(tables, jnp.int32), view.layer, LAYOUT))


def test_append_rejects_unmapped_blocks_it_writes():
    tables = np.zeros((C, L), np.int32)
    tables[2, 1] = -1  # row 2, block 1
    tables[0, 1] = N  # row 0, block 1: >= N
    a = _with_tables(_paged(), tables)

    def check(**kw):
        b = dict(a, **kw)
        validation.check_paged_append(b["view"], b["table_rows"], b["positions"], b["k"], b["v"], b["valid"])

    check()  # table_rows (0, 2), positions (0, 5), valid (3, 1): blocks [0, 1) of both rows: fine
    with pytest.raises(ValueError, match=(
        r"block_tables\[2, 1\] = -1 \(table row 2 = table_rows\[1\], logical block 1\) is not a physical page: "
        r"paged_append uses blocks \[1, 2\) of that row, whose entries must lie in \[0, N=6\)")):
        _call(ops.paged_append, dict(a, positions=i32(0, 64)))
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 6 \(table row 0 = table_rows\[0\]"):
        _call(ops.paged_append, dict(a, positions=i32(62, 0)))  # tokens 62..64 cross into block 1
    check(positions=i32(61, 0))  # tokens 61..63 stay in block 0
    check(positions=i32(64, 64), valid=i32(0, 0))  # nothing written: nothing checked


def test_attention_rejects_unmapped_blocks_it_reads():
    tables = np.zeros((C, L), np.int32)
    tables[2, 1] = 2**31 - 1
    t = _with_tables(_attn(), tables)
    validation.check_paged_attention(t["q"], t["view"], t["table_rows"], t["positions"], i32(3, 64))  # block 0 only
    with pytest.raises(ValueError, match=(
        r"block_tables\[2, 1\] = 2147483647 \(table row 2 = table_rows\[1\], logical block 1\) is not a physical "
        r"page: paged_attention uses blocks \[0, 2\) of that row")):
        _call(ops.paged_attention, dict(t, kv_lens=i32(3, 65)))


def test_single_sequence_view_checks_its_table_entries():
    from ninfer_kv.ops.views import PagedKVLayerView

    view = _paged()["view"]
    single = PagedKVLayerView(view.planes, jnp.asarray([0, -3], jnp.int32), 0, LAYOUT)
    a = _attn()
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = -3"):
        ops.paged_attention(a["q"], single, None, a["positions"], i32(64, 65), impl="reference")


def test_public_ops_and_views_are_annotated():
    import inspect

    from ninfer_kv.ops import views

    fns = [getattr(ops, name) for name in ops.__all__ if inspect.isfunction(getattr(ops, name))]
    fns += [views.PagedKVBatchLayerView.__init__, views.PagedKVBatchLayerView.with_layer, views.CyclicKVLayout.allocate]
    for fn in fns:
        sig = inspect.signature(fn)
        missing = [p for p in sig.parameters.values() if p.name != "self" and p.annotation is inspect.Parameter.empty]
        assert not missing, f"{fn.__qualname__}: parameters without annotations: {[p.name for p in missing]}"
        assert sig.return_annotation is not inspect.Signature.empty, f"{fn.__qualname__}: no return annotation"
