"""MeshSpec, partition rules and per-device planning (no devices needed)."""

import pytest

from ninfer_kv.device.memory import capacity_from_device
from ninfer_kv.schema.mesh_spec import MeshSpec
from ninfer_kv.planning import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, PlanBoundError, plan_kv_cache, plan_kv_cache_mesh
from ninfer_kv.schema.kinds import PoolKind

MODEL = ModelKVConfig(4, 8, 128, "k8v4")


def test_parse_and_bad_meshes():
    assert MeshSpec.parse("data=2,model=4") == MeshSpec(2, 4)
    assert MeshSpec.parse("model=8") == MeshSpec(1, 8)
    for bad in ("data=0", "data=2,data=3", "rows=2", "data=x", ""):
        with pytest.raises(ValueError):
            MeshSpec.parse(bad)
    with pytest.raises(ValueError, match="different names"):
        MeshSpec(2, 2, "x", "x")


def test_heads_split_or_replicated():
    m = MeshSpec(1, 4)
    assert (m.local_heads(8), m.stored_heads(8), m.head_replication(8)) == (2, 8, 1)
    assert (m.local_heads(2), m.stored_heads(2), m.head_replication(2)) == (1, 4, 2)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        m.local_heads(3)
    with pytest.raises(ValueError, match="max_concurrency=5"):
        MeshSpec(2, 1).local_concurrency(5)


@pytest.mark.parametrize("mesh", ["data=1,model=8", "data=2,model=4", "data=8,model=1"])
def test_per_device_plan_matches_single_device_bytes(mesh):
    spec = MeshSpec.parse(mesh)
    plan = plan_kv_cache_mesh(MODEL, spec, max_context=4096, max_concurrency=16, policy=ExplicitCapacity(65536))
    dev = plan.device.pools[PoolKind.MAIN]
    assert dev.layout.num_kv_heads == 8 // spec.model
    assert dev.max_concurrency == 16 // spec.data
    assert plan.capacity_tokens >= 65536 and plan.m_local * spec.data * 64 == plan.capacity_tokens
    # planes split exactly; each device also holds its shard's whole (C_local, L) table
    single = plan_kv_cache(MODEL, max_context=4096, max_concurrency=16,
                           policy=ExplicitCapacity(plan.capacity_tokens))
    plane_bytes = sum(p.bytes for p in single.pools.values())
    table_bytes = sum(p.table_bytes for p in single.pools.values())
    assert plan.single_device_bytes == single.device_bytes
    assert plan.device_bytes == plane_bytes // spec.size + table_bytes // spec.data
    assert plan.total_bytes == plan.device_bytes * spec.size


def test_replicated_heads_cost():
    model = ModelKVConfig(2, 2, 128, "bf16")
    plan = plan_kv_cache_mesh(model, "data=1,model=4", max_context=1024, max_concurrency=4,
                              policy=ExplicitCapacity(4096))
    single = plan_kv_cache(model, max_context=1024, max_concurrency=4, policy=ExplicitCapacity(4096))
    assert plan.head_replication == 2
    planes = sum(p.bytes for p in single.pools.values())
    assert plan.total_bytes - 4 * sum(p.table_bytes for p in single.pools.values()) == 2 * planes


def test_automatic_policy_is_per_device_and_bad_capacity_names_total():
    plan = plan_kv_cache_mesh(MODEL, "data=2,model=4", max_context=4096, max_concurrency=16,
                              policy=AutomaticCapacity(free_bytes=64 << 20))
    assert plan.device_bytes <= 64 << 20
    with pytest.raises(PlanBoundError, match="kv_capacity=1 .*total over 2 data shards"):
        plan_kv_cache_mesh(MODEL, "data=2,model=4", max_context=4096, max_concurrency=16,
                           policy=ExplicitCapacity(1))


class _FakeDevice:
    def __init__(self, free):
        self.free, self.process_index = free, 0

    def memory_stats(self):
        return {"bytes_limit": self.free, "bytes_in_use": 0}


def test_from_device_takes_the_minimum_over_devices():
    policy = capacity_from_device([_FakeDevice(5 << 30), _FakeDevice(3 << 30), _FakeDevice(4 << 30)])
    assert policy.free_bytes == 3 << 30


def test_cli_plan_mesh(capsys):
    import json

    from ninfer_kv.cli import main

    argv = ["plan", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--profile", "k8v4", "--max-context",
            "4096", "--max-concurrency", "16", "--kv-capacity", "65536", "--mesh", "data=2,model=4"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = plan_kv_cache_mesh(MODEL, "data=2,model=4", max_context=4096, max_concurrency=16,
                              policy=ExplicitCapacity(65536))
    assert data["device_bytes"] == plan.device_bytes and data["total_bytes"] == 8 * plan.device_bytes
    assert data["mesh"] == {"data": 2, "model": 4, "axes": ["data", "model"]}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "per device" in text and f"{plan.device_bytes:,} B" in text
    assert main(argv[:-1] + ["data=3,model=4"]) == 2
    assert "--max-concurrency 16 does not split over the data axis of size 3" in capsys.readouterr().err


def test_backend_pools_split_like_main():
    from ninfer_kv.planning import SpeculativeConfig
    from ninfer_kv.store.sharded import ShardedKVStore

    spec = SpeculativeConfig(method="dflash", draft_full_layers=2, draft_kv_heads=2)
    plan = plan_kv_cache_mesh(MODEL, "data=2,model=4", max_context=1024, max_concurrency=8,
                              policy=ExplicitCapacity(8192), speculative=spec)
    draft = plan.device.pools[PoolKind.DRAFT_FULL].layout
    assert draft.order.value == "head-major" and draft.num_kv_heads == 1  # 2 heads < 4: replicated
    assert plan.shard.pools[PoolKind.DRAFT_FULL].layout.num_kv_heads == 4
    pools = ShardedKVStore(plan).global_pools()
    assert pools[PoolKind.DRAFT_FULL].physical_pages == 2 * plan.m_local
    assert pools[PoolKind.MAIN].table_shape == (8, plan.logical_pages)
    mtp = plan_kv_cache_mesh(MODEL, "data=2,model=4", max_context=1024, max_concurrency=8,
                             policy=ExplicitCapacity(8192), speculative=SpeculativeConfig(method="mtp", draft_window=4))
    assert mtp.device.pools[PoolKind.MTP].physical_pages == mtp.m_local + 4  # C_local * ceil((K-1)/P)
    with pytest.raises(ValueError, match="draft_kv_heads=3"):
        plan_kv_cache_mesh(MODEL, "data=2,model=4", max_context=1024, max_concurrency=8, policy=ExplicitCapacity(8192),
                           speculative=SpeculativeConfig(method="dflash", draft_full_layers=1, draft_kv_heads=3))
