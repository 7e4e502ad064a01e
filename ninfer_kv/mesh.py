"""The device mesh of a sharded KV cache: :class:`MeshSpec` (plain numbers,
:mod:`ninfer_kv.mesh_spec`) and :class:`KVMesh` (the JAX mesh, :mod:`ninfer_kv.device.mesh`),
re-exported here under their original module."""

from __future__ import annotations

from .device.mesh import KVMesh
from .mesh_spec import MeshSpec, parse_mesh

__all__ = ["MeshSpec", "KVMesh", "parse_mesh"]
