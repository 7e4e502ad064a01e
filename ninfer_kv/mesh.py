"""A device mesh for the KV cache: KV heads over a model axis, sequences over a data axis.

:class:`MeshSpec` is the shape of the mesh (sizes and axis names, no devices): planning and the
command line use it.  :class:`KVMesh` binds it to real devices (a ``jax.sharding.Mesh``) and names
the partition spec of every leaf of a :class:`~ninfer_kv.store.KVDeviceState` and of a sharded
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

import dataclasses
import re
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .geometry import PlaneOrder

if TYPE_CHECKING:  # pragma: no cover
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from .store.device_state import KVDeviceState

__all__ = ["MeshSpec", "KVMesh", "parse_mesh"]

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _size(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"mesh axis {name}={value!r} is invalid; it must be an integer >= 1")
    return int(value)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes and names of the two KV mesh axes (either size may be 1).

    ``MeshSpec(data=2, model=4)`` or ``MeshSpec.parse("data=2,model=4")``: 8 devices.

    Attributes:
      data: data shards ``D``, an integer >= 1 (default 1); each shard is its own page pool with
        its own ``C / D`` block-table rows.
      model: model shards ``T``, an integer >= 1 (default 1); the KV heads are split over them
        (``H % T == 0``) or replicated onto them (``T % H == 0``).
      data_axis, model_axis: the mesh axis names (default ``"data"`` and ``"model"``), two
        different Python identifiers.

    Raises:
      ValueError: a size that is not an integer >= 1, an axis name that is not an identifier, or
        the same name for both axes.
    """

    data: int = 1
    model: int = 1
    data_axis: str = "data"
    model_axis: str = "model"

    def __post_init__(self):
        _size(self.data_axis, self.data)
        _size(self.model_axis, self.model)
        for name in (self.data_axis, self.model_axis):
            if not isinstance(name, str) or not _AXIS_NAME.match(name):
                raise ValueError(f"mesh axis name {name!r} is invalid; it must be a Python identifier")
        if self.data_axis == self.model_axis:
            raise ValueError(f"the data and model axes need different names, both are {self.data_axis!r}")
        object.__setattr__(self, "data", int(self.data))
        object.__setattr__(self, "model", int(self.model))

    @classmethod
    def parse(cls, text: "str | MeshSpec") -> "MeshSpec":
        """``"data=2,model=4"`` (either part may be left out; it is then 1)."""
        if isinstance(text, MeshSpec):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a mesh must be a string like 'data=2,model=4', got {type(text).__name__}")
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            key = key.strip()
            if not sep or key not in ("data", "model") or key in sizes:
                raise ValueError(f"mesh {text!r} is invalid; write it as data=D,model=T (each at most once)")
            try:
                sizes[key] = int(val.strip())
            except ValueError:
                raise ValueError(f"mesh {text!r} is invalid: {key}={val.strip()!r} must be an integer >= 1") from None
        if not sizes:
            raise ValueError(f"mesh {text!r} is invalid; write it as data=D,model=T")
        return cls(**sizes)

    @property
    def size(self) -> int:
        """Devices in the mesh, ``D * T``."""
        return self.data * self.model

    def __str__(self) -> str:
        return f"{self.data_axis}={self.data},{self.model_axis}={self.model}"

    def to_json(self) -> dict:
        """``{"data": D, "model": T, "axes": [data_axis, model_axis]}``."""
        return {"data": self.data, "model": self.model, "axes": [self.data_axis, self.model_axis]}

    # -- heads ---------------------------------------------------------------------------------
    def check_heads(self, num_kv_heads: int, what: str = "num_kv_heads") -> None:
        """Raise ``ValueError`` unless the heads split over (or replicate onto) the model axis."""
        h, t = int(num_kv_heads), self.model
        if h % t and t % h:
            raise ValueError(
                f"{what}={h} does not fit the model axis of size {t}: it must be a multiple of {t} "
                f"(split) or divide {t} (replicated)"
            )

    def local_heads(self, num_kv_heads: int) -> int:
        """KV heads each device holds: ``H / T``, or 1 when ``H < T`` (replicated heads)."""
        self.check_heads(num_kv_heads)
        return max(int(num_kv_heads) // self.model, 1)

    def stored_heads(self, num_kv_heads: int) -> int:
        """Heads of the global planes: ``H``, or ``T`` when each head is stored ``T / H`` times."""
        return self.local_heads(num_kv_heads) * self.model

    def head_replication(self, num_kv_heads: int) -> int:
        """How many times each KV head is stored (1 unless ``H < T``)."""
        return self.stored_heads(num_kv_heads) // int(num_kv_heads)

    # -- rows ---------------------------------------------------------------------------------
    def local_concurrency(self, max_concurrency: int) -> int:
        """Rows per data shard ``C_local = C / D`` (``C % D == 0`` required)."""
        c = int(max_concurrency)
        if c % self.data:
            raise ValueError(
                f"max_concurrency={c} does not split over the data axis of size {self.data}: it must be a "
                f"multiple of {self.data}"
            )
        return c // self.data


def parse_mesh(text: "str | MeshSpec") -> MeshSpec:
    """:meth:`MeshSpec.parse`."""
    return MeshSpec.parse(text)


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
        """``P()``: the spec of a leaf every device holds whole (the applied-work serial, the fault flag)."""
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
        """A :class:`~ninfer_kv.store.KVDeviceState` of partition specs matching ``state``."""
        planes = {}
        for kind, pool in state.planes.items():
            page_major = state.page_axis(kind) == PlaneOrder.PAGE_MAJOR.page_axis
            order = PlaneOrder.PAGE_MAJOR if page_major else PlaneOrder.HEAD_MAJOR
            planes[kind] = {name: self.plane_spec(order) for name in pool}
        tables = {kind: self.table_spec() for kind in state.tables}
        rep = self.replicated_spec()
        return state.replace(planes=planes, tables=tables, serial=rep, fault=rep, owner=rep)

    def state_shardings(self, state: "KVDeviceState", memory_kind: str | None = None) -> "KVDeviceState":
        """The ``NamedSharding`` of every leaf of ``state`` (``memory_kind``: e.g. ``"pinned_host"``)."""
        import jax
        from jax.sharding import PartitionSpec

        specs = self.state_specs(state)
        return jax.tree.map(
            lambda s: self.sharding(s, memory_kind), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    # -- inside shard_map ----------------------------------------------------------------------
    def data_index(self) -> "jax.Array":
        """This device's data shard (inside ``shard_map``)."""
        import jax

        return jax.lax.axis_index(self.data_axis)
