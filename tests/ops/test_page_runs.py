"""Gather / scatter of whole pages by physical-ID runs (Host transfers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv import ops
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.ops import gather_page_runs, scatter_page_runs
from ninfer_kv.ops import page_runs

from tests.conformance.cases import poison_planes

N = 12


def _layout(order):
    return PagedKVStorageLayout("k8v4", num_layers=2, num_kv_heads=2, head_dim=64, order=order)


def _planes(layout, seed=0):
    host = poison_planes(layout.plane_shapes(N), layout.plane_dtypes(), np.random.default_rng(seed), mode="bytes")
    return host, {k: jnp.asarray(v) for k, v in host.items()}


def _ids(starts, lengths):
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)] + [np.zeros(0, int)]).astype(int)


def _bytes(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
def test_gather_concatenates_runs_in_order(order):
    layout = _layout(order)
    host, planes = _planes(layout)
    starts, lengths = np.array([7, 0, 3, 11], np.int32), np.array([3, 0, 2, 1], np.int32)  # a padding run inside
    out = gather_page_runs(planes, starts, lengths, layout=layout)
    ids = _ids(starts, lengths)
    axis = order.page_axis
    for name, x in host.items():
        want = np.take(x, ids, axis=axis)
        assert out[name].shape == want.shape and out[name].dtype == want.dtype
        np.testing.assert_array_equal(_bytes(out[name]), want.view(np.uint8))
    # the source planes are untouched (not donated)
    for name, x in host.items():
        np.testing.assert_array_equal(_bytes(planes[name]), x.view(np.uint8))


def test_gather_pads_to_num_pages_with_zeros():
    layout = _layout(PlaneOrder.PAGE_MAJOR)
    host, planes = _planes(layout)
    out = gather_page_runs(planes, [2], [3], layout=layout, num_pages=8)
    for name, x in host.items():
        assert out[name].shape[1] == 8
        np.testing.assert_array_equal(_bytes(out[name][:, :3]), x[:, 2:5].view(np.uint8))
        assert not _bytes(out[name][:, 3:]).any()
    empty = gather_page_runs(planes, np.zeros(0, np.int32), np.zeros(0, np.int32), layout=layout)
    assert empty["k"].shape == (2, 0, 2, 64, 64)


@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.value)
def test_scatter_is_the_inverse_and_touches_nothing_else(order):
    layout = _layout(order)
    host, planes = _planes(layout, seed=1)
    src_host, src = _planes(layout, seed=2)
    payload = gather_page_runs(src, [1, 9], [2, 3], layout=layout, num_pages=6)  # 5 pages + 1 padding
    dst_starts, dst_lengths = np.array([4, 0, 8], np.int32), np.array([2, 0, 3], np.int32)
    old = planes
    new = scatter_page_runs(planes, dst_starts, dst_lengths, payload, layout=layout)
    assert all(x.is_deleted() for x in old.values())  # donated: written in place
    ids_src, ids_dst = _ids([1, 9], [2, 3]), _ids(dst_starts, dst_lengths)
    axis = order.page_axis
    for name, x in host.items():
        want = x.copy()
        idx = [slice(None)] * x.ndim
        idx[axis] = ids_dst
        want[tuple(idx)] = np.take(src_host[name], ids_src, axis=axis)
        np.testing.assert_array_equal(_bytes(new[name]), want.view(np.uint8))


def test_run_structure_is_data_not_a_graph_key():
    layout = _layout(PlaneOrder.PAGE_MAJOR)
    _, planes = _planes(layout)
    before = page_runs._gather._cache_size()
    for starts, lengths in (([0, 5, 9], [2, 3, 1]), ([8, 1, 3], [1, 1, 4]), ([11, 0, 2], [1, 0, 5])):
        gather_page_runs(planes, np.array(starts, np.int32), np.array(lengths, np.int32), layout=layout, num_pages=6)
    assert page_runs._gather._cache_size() == before + 1
    gather_page_runs(planes, np.array([0], np.int32), np.array([6], np.int32), layout=layout, num_pages=6)
    assert page_runs._gather._cache_size() == before + 2  # R is a shape: 1 run vs 3 runs


def test_run_page_ids():
    ids = jax.jit(page_runs.run_page_ids, static_argnums=(2, 3))(
        jnp.asarray([7, 0, 3], jnp.int32), jnp.asarray([3, 0, 2], jnp.int32), 7, 12
    )
    np.testing.assert_array_equal(np.asarray(ids), [7, 8, 9, 3, 4, 12, 12])


def test_errors_name_the_bad_run():
    layout = _layout(PlaneOrder.PAGE_MAJOR)
    _, planes = _planes(layout)
    with pytest.raises(ValueError, match=r"run 1 = pages \[10, 13\) is out of range; runs must lie in \[0, N=12\)"):
        gather_page_runs(planes, [0, 10], [1, 3], layout=layout)
    with pytest.raises(ValueError, match=r"run_lengths\[0\]=-1 is negative"):
        gather_page_runs(planes, [0], [-1], layout=layout)
    with pytest.raises(ValueError, match="num_pages=2 is invalid; it must be an integer >= sum"):
        gather_page_runs(planes, [0], [3], layout=layout, num_pages=2)
    with pytest.raises(ValueError, match="run_starts and run_lengths must have one length"):
        gather_page_runs(planes, [0, 1], [3], layout=layout)
    payload = gather_page_runs(planes, [0], [4], layout=layout)
    with pytest.raises(ValueError, match=r"runs \[2, 4\) and \[3, 5\) overlap"):
        scatter_page_runs(planes, [2, 3], [2, 2], payload, layout=layout)
    with pytest.raises(ValueError, match="payload holds 4 pages, fewer than sum"):
        scatter_page_runs(planes, [0], [5], payload, layout=layout)
    with pytest.raises(ValueError, match="payload plane 'v' has shape"):
        scatter_page_runs(planes, [0], [4], dict(payload, v=payload["v"][:, :3]), layout=layout)
    with pytest.raises(ValueError, match="planes keyed"):
        gather_page_runs({"k": planes["k"]}, [0], [1], layout=layout)
    with pytest.raises(TypeError, match="run_starts must hold integers .* got dtype float64"):
        gather_page_runs(planes, [0.0], [1], layout=layout)
    with pytest.raises(ValueError, match=r"run_lengths must be a 1-D integer array, got shape \(1, 1\)"):
        gather_page_runs(planes, [0], [[1]], layout=layout)
    # nothing was donated by the failed calls
    assert not any(x.is_deleted() for x in planes.values())


def test_runs_and_page_ids_accept_any_integer_array_like():
    layout = _layout(PlaneOrder.HEAD_MAJOR)
    _, planes = _planes(layout)
    want = gather_page_runs(planes, np.array([7, 2], np.int32), np.array([2, 1], np.int32), layout=layout)
    for starts, lengths in [([7, 2], (2, 1)), (np.array([7, 2], np.uint8), np.array([2, 1], np.int64)),
                            (jnp.asarray([7, 2], jnp.int32), jnp.asarray([2, 1], jnp.int32))]:
        got = gather_page_runs(planes, starts, lengths, layout=layout)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), np.asarray(want[name]).view(np.uint8))
    z = np.zeros(2, np.int64)
    with pytest.raises(TypeError, match="columns must hold integers"):
        ops.copy_page_columns(planes, z, z + 1, np.array([1.0, 0.0]), layout=layout)
    with pytest.raises(ValueError, match=r"dst\[0\]=4294967296 does not fit in int32"):
        ops.copy_page_columns(planes, z, np.array([2**32, 1], np.int64), [1, 0], layout=layout)
    out = ops.copy_page_columns(planes, [1, 0], np.array([3, 0], np.uint16), (5, 0), layout=layout)
    assert set(out) == set(layout.plane_names)


def test_scatter_updates_integer_planes_in_place():
    """NVFP4 planes are all bytes: the donated scatter's temporaries do not grow with the pool."""
    layout = PagedKVStorageLayout("nvfp4-g16", num_layers=2, num_kv_heads=2, head_dim=64)
    s = jax.ShapeDtypeStruct

    def temp(n):
        planes = {k: s(v, layout.plane_dtypes()[k]) for k, v in layout.plane_shapes(n).items()}
        payload = {k: s(v, layout.plane_dtypes()[k]) for k, v in layout.plane_shapes(4).items()}
        runs = s((2,), jnp.int32)
        compiled = page_runs._scatter.lower(planes, runs, runs, payload, page_axis=1).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp(16), temp(128)
    assert large <= small, (small, large)
    assert large < layout.buffer_bytes(16)


_RUN_IDS = jax.jit(page_runs.run_page_ids, static_argnums=(2, 3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 4)), min_size=1, max_size=4), st.integers(0, 4))
def test_run_page_ids_property(runs, extra):
    """Payload page i holds physical page ids[i]; pages past the total are padding (id N)."""
    runs = [(min(s, N - n), n) for s, n in runs]
    runs += [(0, 0)] * (4 - len(runs))  # fixed R = 4: one compiled program for every example
    starts, lengths = np.array(runs, np.int32).T
    want = _ids(starts, lengths)
    n_out = 16 + extra
    got = np.asarray(_RUN_IDS(jnp.asarray(starts), jnp.asarray(lengths), n_out, N))
    np.testing.assert_array_equal(got[: want.size], want)
    assert (got[want.size :] == N).all()
