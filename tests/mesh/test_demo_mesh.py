"""``ninfer-kv demo --mesh``: the same tokens as one device, planes sharded, never gathered.

Each run is a fresh subprocess (a mesh needs its devices forced before JAX starts)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SMALL = ["--model", "tiny", "--max-context", "256", "--max-concurrency", "4", "--kv-capacity", "640",
         "--requests", "6", "--max-new-tokens", "8", "--system-prompts", "2", "--system-prompt-tokens", "100",
         "--impl", "ffi", "--seed", "5", "--no-progress", "--json"]
"""6 requests on the tiny model, 4 of them sharing two system prompts; 10 Main pages over 4 rows."""


def _env(**extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # XLA_FLAGS is inherited: the demo replaces any forced device count in it with its own.
    env.update(extra)
    return env


def _demo(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ninfer_kv", "demo", *argv], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mesh_tokens_equal_one_device():
    """data=2,model=4 (8 forced host devices) and one device, same seed: same tokens digest, dense
    match, no leaks; prefixes are forked on the shard that holds them."""
    one = _demo(*SMALL)
    mesh = _demo(*SMALL, "--mesh", "data=2,model=4")
    assert one["mesh"] is None and mesh["mesh"] == {"data": 2, "model": 4}
    assert one["dense_match"] is True and mesh["dense_match"] is True
    assert len(one["tokens_digest"]) == 64 and mesh["tokens_digest"] == one["tokens_digest"]
    assert mesh["generated_tokens"] == one["generated_tokens"]
    assert mesh["prefix_hits"] > 0 and mesh["leaked_pages"] == 0 and mesh["leaked_host_extents"] == 0
    assert mesh["plan"]["mesh"]["data"] == 2 and mesh["plan"]["kv_heads_per_device"] == 1
    assert mesh["pool_pages"] == {"main": 10}  # 5 per data shard
    # every shard's units of a round share one mesh step: a step serves lanes of both shards
    steps = mesh["mesh_steps"]
    assert steps["steps"] == sum(mesh["units"].values()), (steps, mesh["units"])
    assert steps["max_lanes_per_step"] > 2, steps  # more than one shard's 2 local rows
    assert steps["slots_per_step"] >= steps["lanes_per_step"] > 0


_PLANES_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from ninfer_kv.demo import DemoConfig, WorkloadSpec
    from ninfer_kv.demo.drafter import demo_params as _params
    from ninfer_kv.demo.run import validate
    from ninfer_kv.device.mesh import KVMesh
    from ninfer_kv.device.rounds import take_step_work
    from ninfer_kv.engine import DecoderModel
    from ninfer_kv.engine.data_parallel import DataParallelEngine
    from ninfer_kv.schema.kinds import PoolKind
    from ninfer_kv.planning import ExplicitCapacity
    from ninfer_kv.store.sharded import ShardedKVStore

    cfg = DemoConfig(workload=WorkloadSpec(requests=2), model="tiny", impl="ffi", max_context=256,
                     max_concurrency=4, capacity=ExplicitCapacity(640), mesh="data=2,model=4")
    plan, _ = validate(cfg)
    kv_mesh = KVMesh(cfg.mesh)
    sharded = ShardedKVStore(plan, kv_mesh)
    params, _ = _params(cfg.model_config, 0)
    engine = DataParallelEngine(DecoderModel(params, cfg.model_config, impl="ffi", mesh=kv_mesh), sharded)
    shared, steps = engine.runner, engine.runner.model.steps
    plane = next(iter(shared.state.planes[PoolKind.MAIN].values()))
    n_glob, h_glob = plane.shape[1], plane.shape[2]
    local = plane.addressable_shards[0].data.shape
    assert (local[1], local[2]) == (n_glob // 2, h_glob // 4), (plane.shape, local)
    work = take_step_work(sharded, shared.state, (64, 0, 0))[1]
    b = 4
    i32 = jax.ShapeDtypeStruct((b,), np.int32)
    tok = jax.ShapeDtypeStruct((b, 1), np.int32)
    text = steps.on_state("decode").lower(params, shared.state, work, tok, i32, i32, i32).compile().as_text()
    colls = [ln for ln in text.splitlines()
             if any(op + "(" in ln or op + "-start(" in ln
                    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"))]
    dims = f"{plane.shape[0]},{n_glob},{h_glob},"
    bad = [ln for ln in colls if dims in ln or f",{n_glob // 2},{h_glob // 4}," in ln]
    assert not bad, bad
    calls = [ln for ln in text.splitlines() if "custom-call(" in ln]
    assert any(f"[{plane.shape[0]},{n_glob // 2},{h_glob // 4}," in ln for ln in calls), "no per-device FFI call"
    assert not any(dims in ln for ln in calls), "an FFI call saw the global planes"
    print("planes sharded ok", len(colls))
    """
)


def test_mesh_step_keeps_planes_on_their_devices():
    """The engine's compiled mesh decode step: each FFI call sees one device's block of the planes and
    no collective moves a plane (only activations cross devices)."""
    proc = subprocess.run([sys.executable, "-c", _PLANES_SCRIPT], capture_output=True, text=True, timeout=120,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 0 and "planes sharded ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_mesh_after_jax_started_exits_2():
    """JAX already started with one device: ``--mesh data=2,model=4`` is a one-line usage error."""
    script = (
        "import sys, jax; jax.devices(); from ninfer_kv.cli import main; "
        f"sys.exit(main(['demo', '--mesh', 'data=2,model=4', '--requests', '2', '--no-progress']))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mesh needs 8 devices, JAX started with 1" in lines[0], proc.stderr
