"""Reading memory: free device memory (the device half of the automatic capacity policy), a
device's memory limit, and the host's physical and available memory.

Every read of ``memory_stats()``, ``/proc/meminfo`` or the ``sysconf`` page counts in the package
is here.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from ..planning.config import AutomaticCapacity
from ..schema.sizes import ByteSize

__all__ = ["free_device_bytes", "devices_of", "capacity_from_device", "device_memory_limit", "host_memory_bytes",
           "host_available_bytes"]


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


def device_memory_limit(device=None) -> int | None:
    """The memory a device holds in all (``bytes_limit`` of ``memory_stats()``; ``None``: the first
    device), or ``None`` when it reports no memory statistics (a CPU)."""
    dev = devices_of(device)[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a platform without memory statistics
        return None
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def host_memory_bytes() -> int | None:
    """Bytes of physical memory of this machine, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
        return None


def host_available_bytes() -> int:
    """Bytes of memory this machine has available (``MemAvailable`` of ``/proc/meminfo``, else the
    free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
