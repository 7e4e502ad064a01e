"""MeshSpec: the shape of a data x model device mesh, as plain numbers (a leaf of the package).

``data`` shards requests (each data shard is its own pool set: page IDs, capacity, rows); ``model``
shards KV heads.  Planning (:mod:`ninfer_kv.planning`) and the store reason about a mesh only
through this spec; the JAX mesh itself is :class:`~ninfer_kv.device.mesh.KVMesh`.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

__all__ = ["MeshSpec", "parse_mesh"]

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
