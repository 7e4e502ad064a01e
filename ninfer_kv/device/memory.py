"""Reading free device memory (the device half of the automatic capacity policy)."""

from __future__ import annotations

import jax
import numpy as np

from ..planning.config import AutomaticCapacity
from ..schema.sizes import ByteSize

__all__ = ["free_device_bytes", "devices_of", "capacity_from_device"]


def devices_of(device) -> list:
    """The addressable devices named by ``device``: one device, a sequence of devices, a
    ``jax.sharding.Mesh`` or a :class:`~ninfer_kv.device.mesh.KVMesh` (``None``: the first device)."""
    if device is None:
        return [jax.devices()[0]]
    mesh = getattr(device, "mesh", device)  # a KVMesh carries a jax Mesh
    if hasattr(mesh, "devices") and hasattr(mesh, "axis_names"):
        devices = list(np.asarray(mesh.devices).flat)
    elif isinstance(device, (list, tuple)):
        devices = list(device)
    else:
        return [device]
    local = [d for d in devices if d.process_index == jax.process_index()]
    if not local:
        raise ValueError("none of the mesh's devices belongs to this process")
    return local


def free_device_bytes(device=None) -> int:
    """The minimum free memory (``bytes_limit - bytes_in_use`` of ``memory_stats()``) over the
    devices ``device`` names, at least 0.

    Raises:
      ValueError: a device reports no ``memory_stats()`` (a CPU): pass the free bytes yourself.
    """
    free = None
    for dev in devices_of(device):
        stats = dev.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(
                f"device {dev} reports no memory_stats(); pass AutomaticCapacity(free_bytes=...) explicitly"
            )
        f = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        free = f if free is None else min(free, f)
    return max(free, 0)


def capacity_from_device(device=None, headroom_bytes: ByteSize = 0) -> AutomaticCapacity:
    """An :class:`~ninfer_kv.planning.AutomaticCapacity` whose free bytes F are read from
    ``device.memory_stats()`` (GPU); on a CPU pass F to ``AutomaticCapacity`` yourself.

    ``device`` may be one device, a sequence of devices, a ``jax.sharding.Mesh`` or a
    :class:`~ninfer_kv.device.mesh.KVMesh`: F is then the *minimum* free memory over them (every
    device of a mesh holds the same per-device share of the plan, so the tightest one decides).  In
    a multi-process program only this process's devices can be read; each process then plans from
    its own minimum, so pass the global minimum explicitly when the hosts differ.
    """
    return AutomaticCapacity(free_bytes=free_device_bytes(device), headroom_bytes=headroom_bytes)
