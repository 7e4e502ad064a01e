"""The device layer: everything that holds or changes device arrays.

The store (:mod:`ninfer_kv.store`) is host-only bookkeeping; it hands the device plain numpy data
(:mod:`ninfer_kv.work`).  This package owns what runs on the device:

* :mod:`.state` — :class:`KVDeviceState`, the caller-owned pytree of planes, block tables and the
  applied-work serial;
* :mod:`.work` — :func:`apply_work` / :func:`apply_work_jit`, :func:`take_step_work`,
  :func:`gather_pages` and :func:`resync`;
* :mod:`.page_copy` — the page writes of works and ``copy_page_columns``;
* :mod:`.memory` — reading free device memory (the automatic capacity policy);
* :mod:`.allocation` — a plan's plane buffers (``KVPoolSetLayout.allocate``);
* :mod:`.sharded_store` — the mesh programs of a sharded store (allocate a state, apply a work
  alone, pad a step's work, gather an offload per device);
* :mod:`.mesh` — :class:`KVMesh`, the JAX mesh of a sharded cache;
* :mod:`.host_transfer` — Device <-> Host page copies of the Host tier;
* :mod:`.sharded_ops` — every op per shard inside ``shard_map`` (imported on its own: it sits
  above :mod:`ninfer_kv.ops`, which uses this package's page copies).

Imports point one way: vocabulary leaves <- planning <- store <- device <- ops <- models.  The
device layer imports nothing of the store (it takes a store by duck type).
"""

from __future__ import annotations

from .host_transfer import TRANSFER_PATHS, offload_pages, restore_pages
from .memory import devices_of, free_device_bytes
from .mesh import KVMesh
from .page_copy import copy_page_columns
from .state import BLANK, POISONED, KVDeviceState, SyncStatus, check_live
from .work import apply_work, apply_work_jit, gather_pages, gather_pages_jit, resync, take_step_work

__all__ = [
    "KVDeviceState",
    "SyncStatus",
    "POISONED",
    "BLANK",
    "check_live",
    "apply_work",
    "apply_work_jit",
    "gather_pages",
    "gather_pages_jit",
    "resync",
    "take_step_work",
    "copy_page_columns",
    "free_device_bytes",
    "devices_of",
    "KVMesh",
    "offload_pages",
    "restore_pages",
    "TRANSFER_PATHS",
]
