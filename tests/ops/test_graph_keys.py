"""Graph keys never depend on page IDs, table rows, positions, lengths or the layer index.

A jitted step (append + attention, planes donated) is called with fresh page permutations, table
rows, positions, lengths and layers; the backend must compile it exactly once.  Compiles are
counted with JAX's ``/jax/core/compile/backend_compile_duration`` monitoring event, and the test
shows that the counter does see a recompilation when a shape changes.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops import dispatch
from ninfer_kv.ops import registry

from .steps import decode_step
from ninfer_kv.ops.views import allocate_planes

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_backend_compiles():
    """Yields a list whose length is the number of backend compilations inside the block."""
    seen = []

    def listener(event, duration_secs, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            seen.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


LAYERS, H, D, C, L, T = 3, 1, 64, 3, 2, 2
N = C * L + 1


def _inputs(rng, batch):
    """Fresh step inputs: a new page permutation, shuffled table rows, new positions/lengths/layer."""
    tables = rng.permutation(N)[: C * L].reshape(C, L).astype(np.int32)
    rows = rng.permutation(C)[:batch].astype(np.int32)
    positions = rng.integers(0, L * 64 - T, size=batch).astype(np.int32)
    valid = rng.integers(0, T + 1, size=batch).astype(np.int32)
    kv_lens = (positions + valid).astype(np.int32)
    layer = np.int32(rng.integers(0, LAYERS))
    k = rng.standard_normal((batch, T, H, D)).astype(np.float32)
    q = rng.standard_normal((batch, T, 2 * H, D)).astype(np.float32)
    host = (tables, layer, rows, positions, k, k, valid, q, kv_lens)
    return [jnp.asarray(x) for x in host]


@pytest.mark.parametrize("impl", ["reference", "ffi", pytest.param("pallas", marks=pytest.mark.slow)])  # interpret mode is slow
def test_step_compiles_once_across_page_ids_rows_positions_lengths_and_layers(impl):
    if impl not in registry.available_impls():
        pytest.skip(f"implementation {impl!r} is not available here")
    layout = PagedKVStorageLayout("k8v4", num_layers=LAYERS, num_kv_heads=H, head_dim=D)
    step = decode_step(impl, layout)
    rng = np.random.default_rng(0)
    planes = allocate_planes(layout, N)
    planes, _ = step(planes, *_inputs(rng, batch=2))  # first call compiles
    batches = [_inputs(rng, batch=2) for _ in range(4)]  # built before counting
    with count_backend_compiles() as compiles:
        for args in batches:
            planes, out = step(planes, *args)
        out.block_until_ready()
    assert len(compiles) == 0, f"{impl}: {len(compiles)} recompilations for new page IDs / rows / positions / layer"
    assert step._cache_size() == 1
    # the counter does detect a recompilation: a new batch size is a new shape
    other = _inputs(rng, batch=3)
    with count_backend_compiles() as compiles:
        planes, out = step(planes, *other)
        out.block_until_ready()
    assert len(compiles) >= 1
    assert step._cache_size() == 2
