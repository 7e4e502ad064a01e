"""How the Host tier's copies reach a device: the memory kind they stage through, and the copies.

A :class:`~ninfer_kv.host.arena.HostKVArena` is plain host memory: it records the device it
serves and the requested ``staging``.  This module turns that into transfers.

Memory kind.  Where the device's platform is a GPU and it exposes JAX's ``pinned_host`` memory,
transfers stage through page-locked memory (``memory_kind == "pinned_host"``): a Device -> Host
copy is first placed in ``pinned_host`` memory by the DMA engine and then copied into the arena;
a Host -> Device copy goes numpy -> ``pinned_host`` -> device.  JAX's CPU client also lists a
``pinned_host`` memory kind, but there it is ordinary host memory and staging through it would add
a copy, so on CPU the arena's bytes are used directly (``memory_kind == "host"``).  The arena's
``staging`` overrides the choice (``"pinned_host"`` forces staging where the memory kind exists,
``"direct"`` disables it).

Lifetime.  :func:`to_device` never leaves a device array aliasing the arena (``may_alias=False``
is not honoured by every client, so aliasing is detected and replaced by a private copy), but the
runtime may read the host bytes after ``device_put`` returns; the host bytes are free once the
returned array is ready (``block_until_ready``), which
:func:`~ninfer_kv.device.host_copies.restore_pages` awaits before it returns.
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ..host.arena import STAGING_MODES, HostKVArena

__all__ = ["HostStaging", "select_memory_kind", "staging_of", "start_to_host", "to_device"]

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _has_memory_kind(device, kind: str) -> bool:
    try:
        return any(m.kind == kind for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def select_memory_kind(device, staging: str = "auto") -> str:
    """The memory kind transfers for ``device`` stage through: ``"pinned_host"`` or ``"host"``."""
    if staging not in STAGING_MODES:
        raise ValueError(f"staging={staging!r} is invalid; allowed: {', '.join(STAGING_MODES)}")
    if staging == "direct":
        return "host"
    pinned = _has_memory_kind(device, "pinned_host")
    if staging == "pinned_host":
        if not pinned:
            raise ValueError(f"staging='pinned_host' requested but device {device} has no pinned_host memory")
        return "pinned_host"
    return "pinned_host" if pinned and device.platform in _GPU_PLATFORMS else "host"


@dataclasses.dataclass(frozen=True)
class HostStaging:
    """The resolved staging of one arena: its device, memory kind and page-locked sharding
    (``None`` when transfers go direct)."""

    device: jax.Device
    memory_kind: str
    pinned: SingleDeviceSharding | None


_RESOLVED: "weakref.WeakKeyDictionary[HostKVArena, HostStaging]" = weakref.WeakKeyDictionary()


def staging_of(arena: HostKVArena) -> HostStaging:
    """The :class:`HostStaging` of ``arena`` (resolved once: the default device when the arena
    names none, the memory kind of its ``staging``)."""
    found = _RESOLVED.get(arena)
    if found is None:
        device = arena.device if arena.device is not None else jax.devices()[0]
        kind = select_memory_kind(device, arena.staging)
        pinned = SingleDeviceSharding(device, memory_kind="pinned_host") if kind == "pinned_host" else None
        found = _RESOLVED[arena] = HostStaging(device, kind, pinned)
    return found


def _aliases(array: jax.Array, host: np.ndarray) -> bool:
    """Whether ``array``'s buffer lies inside ``host``'s memory."""
    try:
        pointer = array.unsafe_buffer_pointer()
    except Exception:  # platforms or memory kinds without a host-visible pointer never alias
        return False
    base = host.ctypes.data
    return base <= pointer < base + host.nbytes


def _put_private(host: np.ndarray, where) -> jax.Array:
    """``device_put`` that never leaves the result aliasing ``host``.

    ``may_alias=False`` is not honoured everywhere (the CPU client of jaxlib 0.10 wraps suitably
    aligned numpy memory in place regardless), and an extent's bytes are reused as soon as the
    extent is freed, so aliasing is detected and replaced by a private copy.
    """
    out = jax.device_put(host, where, may_alias=False)
    if _aliases(out, host):
        out = jax.device_put(np.array(host, copy=True), where)
    return out


def start_to_host(arena: HostKVArena, x: jax.Array) -> jax.Array:
    """Start the Device -> Host copy of ``x`` for ``arena``; ``np.asarray`` of the result completes it."""
    pinned = staging_of(arena).pinned
    if pinned is not None:
        return jax.device_put(x, pinned)
    x.copy_to_host_async()
    return x


def to_device(arena: HostKVArena, host: np.ndarray, sharding=None) -> jax.Array:
    """Start copying host bytes (from ``arena``) to ``sharding`` (``None``: uncommitted, default device).

    The result never aliases the arena; the host bytes must stay unchanged until the returned
    array is ready.
    """
    staging = staging_of(arena)
    if staging.pinned is not None:
        staged = _put_private(host, staging.pinned)
        return jax.device_put(staged, sharding if sharding is not None else staging.device)
    return _put_private(host, sharding)
