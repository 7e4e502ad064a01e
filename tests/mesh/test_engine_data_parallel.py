"""``DataParallelEngine``: a data x model mesh serves the same tokens as one device — greedy and
sampled, seeded or not, with prefixes forked on the shard that holds them — and every shard's units
of a round share one mesh step.

The engine runs in a fresh subprocess (a mesh needs its devices forced before JAX starts)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import numpy as np
    from ninfer_kv.demo.config import MODELS
    from ninfer_kv.demo.drafter import demo_params as _params
    from ninfer_kv.device.mesh import KVMesh
    from ninfer_kv.engine import DecoderModel, EngineCore, SamplingParams
    from ninfer_kv.engine.data_parallel import DataParallelEngine
    from ninfer_kv.schema.mesh_spec import MeshSpec
    from ninfer_kv.models.decoder import ModelConfig
    from ninfer_kv.planning import ExplicitCapacity, plan_kv_cache, plan_kv_cache_mesh
    from ninfer_kv.store import KVStore
    from ninfer_kv.store.sharded import ShardedKVStore

    config = ModelConfig(**MODELS["tiny"])
    params, _ = _params(config, 0)
    kv = config.kv_config("bf16")
    rng = np.random.default_rng(4)
    system = [int(t) for t in rng.integers(1, 256, 90)]
    work = []
    for i in range(10):
        prompt = (system if i % 2 else []) + [int(t) for t in rng.integers(1, 256, int(rng.integers(5, 60)))]
        if i % 3 == 0:
            sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9)  # no seed: the engine's
        elif i % 3 == 1:
            sp = SamplingParams(max_tokens=7, temperature=0.7, seed=100 + i)
        else:
            sp = SamplingParams(max_tokens=9, temperature=0.0)
        work.append((f"r{i}", prompt, sp))

    def drain(engine):
        for rid, prompt, sp in work:
            engine.add_request(rid, prompt, sp)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    done[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
        return done

    one_plan = plan_kv_cache(kv, max_context=256, max_concurrency=4, policy=ExplicitCapacity(12 * 64))
    one = drain(EngineCore(DecoderModel(params, config, impl="ffi"), KVStore(one_plan), seed=3))
    spec = MeshSpec.parse("data=2,model=2")
    mesh_plan = plan_kv_cache_mesh(kv, spec, max_context=256, max_concurrency=4, policy=ExplicitCapacity(12 * 64))
    kv_mesh = KVMesh(spec)
    engine = DataParallelEngine(DecoderModel(params, config, impl="ffi", mesh=kv_mesh),
                                ShardedKVStore(mesh_plan, kv_mesh), seed=3)
    mesh = drain(engine)
    assert {k: v[0] for k, v in mesh.items()} == {k: v[0] for k, v in one.items()}, (mesh, one)
    assert sum(v[1] for v in mesh.values()) > 0  # prefixes reused on their shard
    runner = engine.runner
    assert max(runner.lanes) > 2, runner.lanes  # a mesh step served both shards' rows
    engine.clear_cache()
    for core in engine.cores:
        core.store.audit_invariants()
        assert core.store.occupancy().allocated == 0
    print("data parallel ok", len(runner.lanes))
    """
)


def test_data_parallel_engine_serves_the_tokens_of_one_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0 and "data parallel ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]
