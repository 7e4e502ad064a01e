"""copy_page_columns: exact bytes in every plane and layer, both plane orders, no-op padding."""

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.ops.page_copy import compiled_variants, copy_page_columns
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import allocate_planes


def _random_planes(layout, n, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in layout.plane_shapes(n).items():
        dt = layout.plane(name).dtype
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
        out[name] = raw.view(dt).reshape(shape)
    return out


@pytest.mark.parametrize(
    "profile,order,dim",
    [("k8v4", "page-major", 32), ("int8-g64", "page-major", 64), ("bf16", "head-major", 16), ("nvfp4-g16", "head-major", 32)],
)
def test_copies_columns_of_every_plane_and_layer(profile, order, dim):
    layout = PagedKVStorageLayout(profile, num_layers=3, num_kv_heads=2, head_dim=dim, order=order)
    n = 9
    before = _random_planes(layout, n)
    planes = {k: jnp.asarray(v) for k, v in before.items()}
    src = np.array([1, 4, 0, 0], np.int32)
    dst = np.array([7, 2, 0, 0], np.int32)
    cols = np.array([40, 64, 0, 0], np.int32)
    out = copy_page_columns(planes, src, dst, cols, layout=layout)
    axis = layout.order.page_axis
    for name, x in before.items():
        got = np.asarray(out[name])
        assert got.dtype == x.dtype and got.shape == x.shape
        for p in range(n):
            g = np.take(got, p, axis=axis)  # (Lyr, H, P, X)
            b = np.take(x, p, axis=axis)
            if p == 7:
                assert g[:, :, :40].tobytes() == np.take(x, 1, axis=axis)[:, :, :40].tobytes()
                assert g[:, :, 40:].tobytes() == b[:, :, 40:].tobytes()
            elif p == 2:
                assert g.tobytes() == np.take(x, 4, axis=axis).tobytes()
            else:
                assert g.tobytes() == b.tobytes(), (name, p)


def test_validation_errors():
    layout = PagedKVStorageLayout("bf16", num_layers=1, num_kv_heads=1, head_dim=8)
    planes = allocate_planes(layout, 4)
    z = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="columns must lie"):
        copy_page_columns(planes, z, z + 1, np.array([65, 0], np.int32), layout=layout)
    with pytest.raises(ValueError, match="dst page IDs"):
        copy_page_columns(planes, z, np.array([4, 0], np.int32), np.array([3, 0], np.int32), layout=layout)
    with pytest.raises(ValueError, match="distinct"):
        copy_page_columns(planes, np.array([0, 1], np.int32), np.array([2, 2], np.int32), np.array([3, 3], np.int32), layout=layout)
    with pytest.raises(ValueError, match="also an active source"):
        copy_page_columns(planes, np.array([0, 1], np.int32), np.array([1, 2], np.int32), np.array([3, 3], np.int32), layout=layout)
    with pytest.raises(ValueError, match="one length"):
        copy_page_columns(planes, z, z, np.zeros(3, np.int32), layout=layout)
    other = PagedKVStorageLayout("bf16", num_layers=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="layout needs"):
        copy_page_columns(planes, z, z, z, layout=other)


def test_compiles_once_per_padded_length():
    layout = PagedKVStorageLayout("bf16", num_layers=1, num_kv_heads=1, head_dim=8)
    planes = allocate_planes(layout, 6)
    warm = np.zeros(8, np.int32)
    warm[0] = 5
    planes = copy_page_columns(planes, np.zeros(8, np.int32), np.ones(8, np.int32), warm, layout=layout)
    size = compiled_variants()
    rng = np.random.default_rng(0)
    for _ in range(20):
        src, dst = rng.choice(6, size=2, replace=False)
        cols = np.zeros(8, np.int32)
        cols[0] = rng.integers(1, 65)
        s = np.zeros(8, np.int32)
        d = np.zeros(8, np.int32)
        s[0], d[0] = src, dst
        planes = copy_page_columns(planes, s, d, cols, layout=layout)
    assert compiled_variants() == size
