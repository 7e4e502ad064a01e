"""Fixtures of the Host replica tier tests."""

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.layout import PagedKVStorageLayout


def random_planes(layout: PagedKVStorageLayout, num_pages: int, seed: int) -> dict:
    """Planes filled with uniformly random bytes (every bit pattern, NaNs of every kind included)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in layout.plane_shapes(num_pages).items():
        dtype = layout.plane(name).dtype
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        out[name] = jnp.asarray(raw.view(dtype).reshape(shape))
    return out


def page_bytes(planes: dict, layout: PagedKVStorageLayout, page_ids) -> dict:
    """Per plane: the bytes of the given physical pages, stacked in the given order, as uint8."""
    axis = layout.order.page_axis
    return {n: np.take(np.asarray(p), np.asarray(page_ids), axis=axis).view(np.uint8) for n, p in planes.items()}


@pytest.fixture
def make_planes():
    return random_planes


@pytest.fixture
def pages_of():
    return page_bytes
