"""Planning over a device mesh: one shard plan per data shard, the per-device layouts and the totals."""

from __future__ import annotations

import dataclasses

from ..schema.geometry import PAGE_SIZE, ceil_div
from ..schema.kinds import PoolKind
from ..schema.mesh_spec import MeshSpec
from ..schema.sizes import ByteSize
from .bounds import PlanBoundError, _int_at_least
from .config import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, SpeculativeConfig
from .plan import KVPlan, plan_kv_cache
from .pool_set import KVPoolSetLayout

__all__ = ["MeshKVPlan", "plan_kv_cache_mesh"]

@dataclasses.dataclass(frozen=True)
class MeshKVPlan:
    """A plan over a ``data x model`` device mesh (see :mod:`ninfer_kv.schema.mesh_spec`).

    Attributes:
      mesh: the :class:`~ninfer_kv.schema.mesh_spec.MeshSpec`.
      model: the model as given (all ``H`` KV heads).
      device: the plan of **one device**: ``H_local`` heads (``H / T``, or 1 replicated head),
        ``C_local = C / D`` rows, ``M_local`` Main pages; its ``B(M)`` curve is the per-device
        curve under the sharding and its ``device_bytes`` what each device allocates.
      shard: the plan of one **data shard** as the host bookkeeping sees it (every stored head of
        the model axis, the same ``C_local`` and ``M_local``): one ``KVStore`` per data shard uses it.
      single_device_bytes: ``B`` of one device holding the same total capacity and concurrency
        unsharded (``None`` where that exceeds a one-device plan's bounds).
    """

    mesh: "object"
    model: ModelKVConfig
    device: KVPlan
    shard: KVPlan
    single_device_bytes: int | None

    @property
    def m_local(self) -> int:
        """Main pages per data shard."""
        return self.device.m

    @property
    def max_concurrency(self) -> int:
        """Total execution rows over the mesh, ``D * C_local``."""
        return self.device.max_concurrency * self.mesh.data

    @property
    def max_context(self) -> int:
        """The per-sequence ceiling ``S`` in tokens."""
        return self.device.max_context

    @property
    def logical_pages(self) -> int:
        """``L = ceil(S / 64)``, logical pages per sequence."""
        return self.device.logical_pages

    @property
    def capacity_tokens(self) -> int:
        """Main capacity over the whole mesh, ``D * M_local * P``."""
        return self.mesh.data * self.device.capacity_tokens

    @property
    def device_bytes(self) -> int:
        """Bytes each device allocates, ``B(M_local)`` of the per-device curve."""
        return self.device.device_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes over the whole mesh, ``D * T * device_bytes``."""
        return self.mesh.size * self.device_bytes

    @property
    def head_replication(self) -> int:
        """How many times each KV head is stored: ``T / H`` when ``H < T``, else 1."""
        return self.mesh.head_replication(self.model.num_kv_heads)

    def to_json(self) -> dict:
        """JSON-ready dict: mesh, heads per device, rows and pages per data shard, capacity and bytes.

        ``per_device`` is :meth:`KVPlan.to_json` of one device's plan; ``ninfer-kv plan --mesh ...
        --json`` prints this with ``policy`` added.
        """
        return {
            "mesh": self.mesh.to_json(),
            "kv_heads": self.model.num_kv_heads,
            "kv_heads_per_device": self.device.pools[PoolKind.MAIN].layout.num_kv_heads,
            "head_replication": self.head_replication,
            "max_concurrency": self.max_concurrency,
            "rows_per_data_shard": self.device.max_concurrency,
            "main_pages_per_data_shard": self.m_local,
            "capacity_tokens": self.capacity_tokens,
            "per_device": self.device.to_json(),
            "device_bytes": self.device_bytes,
            "total_bytes": self.total_bytes,
            "single_device_bytes": self.single_device_bytes,
        }


def plan_kv_cache_mesh(
    model: ModelKVConfig,
    mesh,
    *,
    max_context: int,
    max_concurrency: int,
    policy: "ExplicitCapacity | AutomaticCapacity",
    speculative: SpeculativeConfig | None = None,
    fixed_bytes: ByteSize = 0,
) -> MeshKVPlan:
    """Resolve ``policy`` for ``model`` sharded over ``mesh`` (a ``MeshSpec``, its text or a ``KVMesh``).

    ``max_concurrency`` is the total ``C`` (a multiple of ``D``); ``ExplicitCapacity.kv_capacity``
    is the total Main capacity over the data shards (each shard gets ``ceil(ceil(K / P) / D)``
    pages); ``AutomaticCapacity.free_bytes`` and ``fixed_bytes`` are per device (take F from
    :func:`~ninfer_kv.device.memory.capacity_from_device` over the mesh: the minimum over its devices).
    """

    spec_mesh = MeshSpec.parse(getattr(mesh, "spec", mesh))
    speculative = speculative or SpeculativeConfig()
    c_local = spec_mesh.local_concurrency(_int_at_least("max_concurrency", max_concurrency, 1))
    if model.rings is not None:
        raise ValueError("window rings (ModelKVConfig.rings) are not supported on a mesh yet; plan the model on one "
                         "device, or keep its windowed layers in the Main pool (rings=None)")
    spec_mesh.check_heads(model.num_kv_heads)
    draft_heads = speculative.draft_kv_heads or model.num_kv_heads
    if speculative.has_draft_full:
        spec_mesh.check_heads(draft_heads, "draft_kv_heads")

    def geometry(heads_of):
        m = dataclasses.replace(model, num_kv_heads=heads_of(model.num_kv_heads))
        s = speculative
        if speculative.has_draft_full:
            s = dataclasses.replace(speculative, draft_kv_heads=heads_of(draft_heads))
        return m, s

    dev_model, dev_spec = geometry(spec_mesh.local_heads)
    shard_model, shard_spec = geometry(spec_mesh.stored_heads)
    local_policy = policy
    if isinstance(policy, ExplicitCapacity):
        m_local = ceil_div(ceil_div(policy.kv_capacity, PAGE_SIZE), spec_mesh.data)
        local_policy = ExplicitCapacity(m_local * PAGE_SIZE)
    try:
        device = plan_kv_cache(dev_model, max_context=max_context, max_concurrency=c_local, policy=local_policy,
                               speculative=dev_spec, fixed_bytes=fixed_bytes)
    except PlanBoundError as exc:
        if isinstance(policy, ExplicitCapacity) and exc.name == "kv_capacity":
            b = KVPoolSetLayout(dev_model, max_context, c_local, dev_spec, fixed_bytes)
            d, p = spec_mesh.data, PAGE_SIZE
            lo, hi = max(max_context, (b.m_min - 1) * d * p + 1), b.max_m() * d * p
            raise PlanBoundError(
                "kv_capacity", policy.kv_capacity, f"in [{lo}, {hi}] tokens",
                f"the total over {d} data shards, each taking ceil(ceil(K/P)/D) pages in "
                f"[M_min={b.m_min}, M_max={b.max_m()}] at max_context={max_context}, C_local={c_local}",
            ) from None
        raise
    shard = plan_kv_cache(shard_model, max_context=max_context, max_concurrency=c_local,
                          policy=ExplicitCapacity(device.m * PAGE_SIZE), speculative=shard_spec)
    single = None
    try:
        one = KVPoolSetLayout(model, max_context, c_local * spec_mesh.data, speculative, fixed_bytes)
        m_total = device.m * spec_mesh.data
        one.check_bounds(m_total)
        single = one.device_bytes(m_total)
    except (PlanBoundError, ValueError):
        single = None
    return MeshKVPlan(mesh=spec_mesh, model=model, device=device, shard=shard, single_device_bytes=single)
