"""The device layer: everything that holds or changes device arrays.

The store (:mod:`ninfer_kv.store`) is host-only bookkeeping; it hands the device plain numpy data
(:mod:`ninfer_kv.schema.round_work`).  This package owns what runs on the device, built from the stateless ops
of :mod:`ninfer_kv.ops`:

* :mod:`.state` — :class:`KVDeviceState`, the caller-owned pytree of planes, block tables and the
  applied-work serial;
* :mod:`.allocation` — a layout's planes, a plan's pools, a store's state (:func:`allocate_state`);
* :mod:`.work` — :func:`apply_work` / :func:`apply_work_jit` and :func:`gather_pages`;
* :mod:`.resync` — :func:`resync`, the repair of a state out of line with its store;
* :mod:`.step` — the step API: :func:`begin_step`, :func:`attention` (one call per layer inside
  the step), :func:`end_step` and their :class:`AttentionBatch`;
* :mod:`.rounds` — :func:`run_round` (map -> take -> step -> commit) and :func:`take_step_work`
  (a round's work in a step's fixed shape);
* :mod:`.offload_gather` — a checkpoint's pages gathered for the Host tier (:func:`offload_checkpoint`);
* :mod:`.host_staging`, :mod:`.host_copies` — Device <-> Host page copies of the Host tier;
* :mod:`.memory` — reading free device memory (the automatic capacity policy);
* :mod:`.mesh` — :class:`KVMesh`, the JAX mesh of a sharded cache;
* :mod:`.sharded_ops`, :mod:`.sharded_store` — every op per shard inside ``shard_map``, and the
  mesh programs of a sharded store.

Imports point one way (docs/ARCHITECTURE.md; ``tests/test_import_layers.py`` enforces it): schema
<- planning <- host <- store <- ops <- device <- models.  The device layer takes a store by duck
type and imports nothing of :mod:`ninfer_kv.store`.
"""

from __future__ import annotations

from .host_copies import TRANSFER_PATHS, offload_pages, restore_pages
from .memory import devices_of, free_device_bytes
from .mesh import KVMesh
from .state import KVDeviceState, check_live
from .allocation import allocate_state
from .offload_gather import gather_offload, offload_checkpoint
from .rounds import run_round, take_step_work
from .step import AttentionBatch, attention, begin_step, end_step
from .resync import resync
from .work import apply_work, apply_work_jit, gather_pages, gather_pages_jit

__all__ = [
    "AttentionBatch",
    "begin_step",
    "attention",
    "end_step",
    "KVDeviceState",
    "check_live",
    "apply_work",
    "apply_work_jit",
    "gather_pages",
    "gather_pages_jit",
    "resync",
    "take_step_work",
    "run_round",
    "allocate_state",
    "gather_offload",
    "offload_checkpoint",
    "free_device_bytes",
    "devices_of",
    "KVMesh",
    "offload_pages",
    "restore_pages",
    "TRANSFER_PATHS",
]
