"""A device mesh for the KV cache: KV heads over a model axis, sequences over a data axis.

:class:`MeshSpec` is the shape of the mesh (sizes and axis names, no devices): planning and the
command line use it.  :class:`KVMesh` binds it to real devices (a ``jax.sharding.Mesh``) and names
the partition spec of every leaf of a :class:`~ninfer_kv.device.state.KVDeviceState` and of a sharded
round work.

Sharding rules (``D`` data shards, ``T`` model shards, ``H`` KV heads):

* the KV-head axis of every plane (data and scale planes alike) is split over the model axis;
  ``H % T == 0`` gives ``H / T`` heads per device.  When ``H < T`` (and ``T % H == 0``) every head
  is *stored* ``T / H`` times, one copy per model shard that needs it: the planes then hold
  ``T`` heads, one per device, and cost ``T / H`` times the bytes of the unreplicated cache;
* the page axis is split over the data axis: each data shard is its own pool with its own page
  IDs ``0 .. N_local - 1``;
* block tables ``(D * C_local, L)`` (``P(data)``) are split by row over the data axis and replicated over the
  model axis (each device of a data shard reads the same table); the applied-work serial is
  replicated.

Page-major planes ``(layers, N, H, P, X)`` get ``P(None, data, model)``; head-major planes
``(layers, H, N, P, X)`` get ``P(None, model, data)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..schema.geometry import PlaneOrder
from ..schema.mesh_spec import MeshSpec

if TYPE_CHECKING:  # pragma: no cover
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from .state import KVDeviceState

__all__ = ["KVMesh"]


class KVMesh:
    """A :class:`MeshSpec` on real devices, with the partition specs of the KV state.

    Args:
      spec: a :class:`MeshSpec` or its text (``"data=2,model=4"``).
      devices: the ``D * T`` devices, data-major (default: the first ``D * T`` of ``jax.devices()``,
        which spans every process in a multi-process program).

    Attributes:
      spec: the :class:`MeshSpec`.
      mesh: the ``jax.sharding.Mesh`` of shape ``(D, T)`` with axes ``(data_axis, model_axis)``.

    Raises:
      ValueError: the program has fewer than ``D * T`` devices (default ``devices``), or
        ``devices`` does not hold exactly ``D * T`` of them.
    """

    def __init__(self, spec: "MeshSpec | str", devices: Sequence | None = None):
        import jax
        from jax.sharding import Mesh

        self.spec = MeshSpec.parse(spec)
        if devices is None:
            devices = jax.devices()
            if len(devices) < self.spec.size:
                raise ValueError(
                    f"mesh {self.spec} needs {self.spec.size} devices, the program has {len(devices)}; on a CPU set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={self.spec.size} before JAX starts"
                )
            devices = devices[: self.spec.size]
        devices = list(devices)
        if len(devices) != self.spec.size:
            raise ValueError(f"mesh {self.spec} needs {self.spec.size} devices, got {len(devices)}")
        grid = np.empty((self.spec.data, self.spec.model), dtype=object)
        for i, d in enumerate(devices):
            grid[i // self.spec.model, i % self.spec.model] = d
        self.mesh = Mesh(grid, (self.spec.data_axis, self.spec.model_axis))

    def __repr__(self) -> str:
        return f"KVMesh({self.spec})"

    @property
    def data_axis(self) -> str:
        """Name of the data axis (``spec.data_axis``)."""
        return self.spec.data_axis

    @property
    def model_axis(self) -> str:
        """Name of the model axis (``spec.model_axis``)."""
        return self.spec.model_axis

    @property
    def data(self) -> int:
        """Data shards ``D``."""
        return self.spec.data

    @property
    def model(self) -> int:
        """Model shards ``T``."""
        return self.spec.model

    @property
    def devices(self) -> list:
        """The ``D * T`` devices, data-major (device ``d * T + t`` is data shard ``d``, model shard ``t``)."""
        return list(self.mesh.devices.flat)

    # -- partition specs ------------------------------------------------------------------------
    def plane_spec(self, order: "PlaneOrder | str") -> "PartitionSpec":
        """Spec of a stacked plane (data and scale planes alike)."""
        from jax.sharding import PartitionSpec as P

        order = PlaneOrder.parse(order)
        if order is PlaneOrder.PAGE_MAJOR:
            return P(None, self.data_axis, self.model_axis, None, None)
        return P(None, self.model_axis, self.data_axis, None, None)

    def table_spec(self) -> "PartitionSpec":
        """Spec of an ``int32 (D * C_local, L)`` block table: rows over data, replicated over model
        (``P(data)``, written without the trailing ``None`` as ``shard_map`` returns it, so a
        state that went through a step has the same jit signature as a fresh one)."""
        from jax.sharding import PartitionSpec as P

        return P(self.data_axis)

    def replicated_spec(self) -> "PartitionSpec":
        """``P()``: the spec of a leaf every device holds whole (the state's order record, a work's serial)."""
        from jax.sharding import PartitionSpec as P

        return P()

    def per_shard_spec(self, head_axis: int | None = None, ndim: int = 1) -> "PartitionSpec":
        """Spec of an array stacked per data shard on axis 0 (``head_axis``: also split over model)."""
        from jax.sharding import PartitionSpec as P

        parts: list = [self.data_axis] + [None] * (ndim - 1)
        if head_axis is not None:
            parts[head_axis] = self.model_axis
        return P(*parts)

    def sharding(self, spec: "PartitionSpec", memory_kind: str | None = None) -> "NamedSharding":
        """``NamedSharding(mesh, spec)`` (``memory_kind="pinned_host"`` for the Host tier)."""
        from jax.sharding import NamedSharding

        if memory_kind is None:
            return NamedSharding(self.mesh, spec)
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    def state_specs(self, state: "KVDeviceState") -> "KVDeviceState":
        """A :class:`~ninfer_kv.device.state.KVDeviceState` of partition specs matching ``state``."""
        planes = {}
        for kind, pool in state.planes.items():
            page_major = state.page_axis(kind) == PlaneOrder.PAGE_MAJOR.page_axis
            order = PlaneOrder.PAGE_MAJOR if page_major else PlaneOrder.HEAD_MAJOR
            planes[kind] = {name: self.plane_spec(order) for name in pool}
        tables = {kind: self.table_spec() for kind in state.tables}
        rep = self.replicated_spec()
        return state.replace(planes=planes, tables=tables, sync=rep)

    def state_shardings(self, state: "KVDeviceState", memory_kind: str | None = None) -> "KVDeviceState":
        """The ``NamedSharding`` of every leaf of ``state`` (``memory_kind``: e.g. ``"pinned_host"``)."""
        import jax
        from jax.sharding import PartitionSpec

        specs = self.state_specs(state)
        return jax.tree.map(
            lambda s: self.sharding(s, memory_kind), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    def work_specs(self, work) -> list:
        """Partition specs of a :class:`~ninfer_kv.schema.round_work.ShardedRoundWork`'s leaves, in
        ``jax.tree_util.tree_flatten`` order: per-shard arrays over ``data``, the payload's heads
        also over ``model``, the serial and store identity replicated."""
        import jax

        from . import pytrees  # noqa: F401  (ShardedRoundWork as a pytree)

        specs = []
        for x in jax.tree_util.tree_leaves(work):
            nd = np.ndim(x)
            if nd == 0:
                specs.append(self.replicated_spec())
            elif nd == 6:  # payload (D, R, layers, H, P, X)
                specs.append(self.per_shard_spec(head_axis=3, ndim=6))
            else:
                specs.append(self.per_shard_spec(ndim=nd))
        return specs

    def put_work(self, work):
        """A :class:`~ninfer_kv.schema.round_work.ShardedRoundWork` as global ``jax.Array`` s on the mesh (each
        device gets only its shard's part and its heads of the payload).  Works in a multi-process
        program: every process builds its addressable shards from its own identical host copy."""
        import jax

        from . import pytrees  # noqa: F401

        leaves, treedef = jax.tree_util.tree_flatten(work)
        out = []
        for x, spec in zip(leaves, self.work_specs(work)):
            if isinstance(x, jax.Array):
                out.append(x)
                continue
            x = np.asarray(x)
            out.append(jax.make_array_from_callback(x.shape, self.sharding(spec), lambda idx, x=x: x[idx], dtype=x.dtype))
        return treedef.unflatten(out)

    # -- inside shard_map ----------------------------------------------------------------------
    def data_index(self) -> "jax.Array":
        """This device's data shard (inside ``shard_map``)."""
        import jax

        return jax.lax.axis_index(self.data_axis)
