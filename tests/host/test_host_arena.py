"""HostKVArena: fixed aligned buffer, memory kind, extents of different strides, unchanged on error."""

import jax
import numpy as np
import pytest

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.host import (
    ExtentAllocationError,
    HostKVArena,
    HostKVPageLayout,
    InvalidPlanError,
    StaleExtentError,
)
from ninfer_kv.device.host_staging import select_memory_kind, staging_of, to_device
from ninfer_kv.host.arena import HOST_BUFFER_ALIGNMENT


def test_buffer_is_fixed_aligned_and_capacity_rounded():
    arena = HostKVArena(10_000, alignment=256)
    assert arena.capacity == 10_240 and arena.buffer.nbytes == 10_240
    assert arena.buffer.dtype == np.uint8 and arena.buffer.ctypes.data % HOST_BUFFER_ALIGNMENT == 0
    base = arena.buffer.ctypes.data
    e = arena.allocate(1000, "main")
    v = arena.view(e)
    assert v.size == 1000 and v.ctypes.data == base + e.offset
    arena.free(e)
    assert arena.buffer.ctypes.data == base  # startup-fixed: never reallocated
    with pytest.raises(StaleExtentError):
        arena.view(e)


def test_memory_kind_on_this_platform():
    device = jax.devices()[0]
    arena = HostKVArena(4096)
    if device.platform == "cpu":
        # JAX's CPU client lists pinned_host, but it is ordinary memory: the arena uses numpy directly
        assert staging_of(arena).memory_kind == "host"
    else:
        assert staging_of(arena).memory_kind == select_memory_kind(device)
    assert select_memory_kind(device, "direct") == "host"
    with pytest.raises(ValueError, match="staging='fast'"):
        HostKVArena(4096, staging="fast")


def test_main_and_backend_extents_of_different_strides_share_the_arena():
    main = HostKVPageLayout(PagedKVStorageLayout("k8v4", 2, 2, 64))
    draft = HostKVPageLayout(PagedKVStorageLayout("bf16", 1, 1, 64, order="head-major"))
    assert main.stride != draft.stride
    arena = HostKVArena(8 * main.stride + 8 * draft.stride + 4096)
    m = arena.allocate(main.extent_bytes(3), "main")
    d = arena.allocate(draft.extent_bytes(5), "draft_full")
    m2 = arena.allocate(main.extent_bytes(1), "main")
    occ = arena.occupancy()
    assert occ.tags["main"].used_bytes == 4 * main.stride
    assert occ.tags["draft_full"].used_bytes == 5 * draft.stride
    assert occ.used_bytes == 4 * main.stride + 5 * draft.stride  # exact packed bytes
    assert occ.used_bytes + occ.padding_bytes + occ.free_bytes == arena.capacity
    assert len({m.offset, d.offset, m2.offset}) == 3
    arena.audit_invariants()


def test_exhaustion_and_invalid_plan_leave_arena_unchanged():
    arena = HostKVArena(16 * 256, alignment=256)
    ext = [arena.allocate(256, "main") for _ in range(16)]
    for e in ext[::2]:
        arena.free(e)
    arena.view(ext[1])[:] = 7
    snap, data = arena.snapshot(), arena.buffer.copy()
    occ = arena.occupancy()
    assert occ.free_bytes == 8 * 256 and occ.largest_free_extent == 256
    with pytest.raises(ExtentAllocationError, match="largest free extent is 256 bytes, free bytes 2048"):
        arena.allocate(512, "main")
    with pytest.raises(InvalidPlanError, match="recipe step 0"):
        arena.validate_plan([("allocate", 512, "main"), ("release", ext[1])])
    with pytest.raises(InvalidPlanError):
        arena.execute_plan([("release", ext[3]), ("allocate", 1024)])
    assert arena.snapshot() == snap and np.array_equal(arena.buffer, data)
    (new,) = arena.execute_plan([("release", ext[1]), ("allocate", 768, "mtp")])
    assert new.offset == 0 and arena.occupancy().tags["mtp"].used_bytes == 768


@pytest.mark.parametrize("committed", [False, True])
def test_to_device_never_aliases_the_arena(committed):
    """An extent is reused once freed, so a device copy must own its bytes."""
    arena = HostKVArena(1 << 16)
    e = arena.allocate(8192, "main")
    arena.view(e)[:] = 3
    device = jax.devices()[0] if committed else None
    block = to_device(arena, arena.view(e).reshape(2, 4096), device)
    block.block_until_ready()
    arena.view(e)[:] = 200
    assert np.all(np.asarray(block) == 3)
    assert block.shape == (2, 4096) and block.dtype == np.uint8
