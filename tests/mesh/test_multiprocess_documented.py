"""The multi-process command of docs/MESH.md runs as written: 2 processes on localhost, both exit 0
and print the lines the doc shows (bounded in time; every process is killed on failure)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from .test_multiprocess import _field, _free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "MESH.md"
TIMEOUT_S = 90

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    return [(m.group(1).strip(), m.group(2)) for m in _FENCE.finditer(DOC.read_text())]


def _documented() -> tuple[list[list[str]], list[str]]:
    """The doc's command lines (argv each) and the output lines of the text block that follows."""
    blocks = _blocks()
    for i, (lang, code) in enumerate(blocks):
        if lang == "bash" and "--process-id" in code:
            commands = [shlex.split(line, comments=True) for line in code.splitlines() if line.strip()]
            assert i + 1 < len(blocks) and blocks[i + 1][0] == "text", "the command's output is not shown"
            return commands, blocks[i + 1][1].splitlines()
    raise AssertionError("docs/MESH.md shows no multi-process command")


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # a fresh shell: no forced device count (the example chooses its own); other flags are kept
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = flags
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run_together(commands: list[list[str]], env: dict) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for argv in commands]
    done = []
    try:
        for argv, p in zip(commands, procs):
            out, err = p.communicate(timeout=TIMEOUT_S)
            done.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    finally:
        for p in procs:  # never leave a process behind (a peer that died leaves the other waiting)
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def test_documented_command_runs_on_two_processes():
    commands, shown = _documented()
    assert len(commands) == 2, commands
    port = _free_port()
    runnable = []
    for i, argv in enumerate(commands):
        if argv[-1] == "&":  # started in the background by the shell
            argv = argv[:-1]
        assert argv[:2] == ["python", "examples/sharded_step.py"], argv
        assert argv[argv.index("--process-id") + 1] == str(i) and argv[argv.index("--num-processes") + 1] == "2"
        assert "--local-devices" not in argv  # the documented command needs no device count
        at = argv.index("--coordinator") + 1
        host, _, doc_port = argv[at].rpartition(":")
        assert host == "127.0.0.1" and doc_port.isdigit(), argv[at]
        runnable.append([sys.executable, *argv[1:at], f"{host}:{port}", *argv[at + 1:]])
    results = _run_together(runnable, _env())
    for r in results:
        assert r.returncode == 0, f"{shlex.join(r.args)} failed:\n{r.stderr[-3000:]}"
    shown = [line for line in shown if line.strip()]
    assert len(shown) == 2
    printed = []
    for i, (r, doc_line) in enumerate(zip(results, shown)):
        # the doc's line with its hashes as patterns (their values depend on the version and the
        # CPU); searched in the whole output: JAX's threads print [Gloo] lines to the same stream
        pattern = re.escape(doc_line)
        for name in ("tables", "digest"):
            value = _field(doc_line, name)
            pattern = pattern.replace(value, f"([0-9a-f]{{{len(value)}}})")
        found = re.findall(pattern + r"\n", r.stdout)
        assert len(found) == 1, f"process {i} did not print a line like `{doc_line}`:\n{r.stdout[-2000:]}"
        printed.append(found[0])
    assert printed[0] == printed[1]  # the same block-table hash and output digest on both processes


_NO_SHARDS = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax, numpy as np
    jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    from ninfer_kv import ExplicitCapacity, ModelKVConfig
    from ninfer_kv.device.mesh import KVMesh
    from ninfer_kv.planning import plan_kv_cache_mesh
    from ninfer_kv.store.sharded import ShardedKVStore
    mesh = KVMesh("data=2,model=1")  # the first 2 of the 4 devices: process 0's two
    plan = plan_kv_cache_mesh(ModelKVConfig(1, 2, 64, "bf16"), mesh, max_context=256, max_concurrency=2,
                              policy=ExplicitCapacity(kv_capacity=512))
    store = ShardedKVStore(plan, mesh)
    rows = store.batch_rows([[store.activate(70, 0, shard=0)], [store.activate(40, 0, shard=1)]], 1)
    store.map(rows, [70, 40])
    work = store.take_work()
    host = jax.tree.leaves(work)
    put = jax.tree.leaves(work.device_put(mesh))
    assert [np.dtype(a.dtype) for a in put] == [np.asarray(x).dtype for x in host]
    assert [a.shape for a in put] == [np.shape(x) for x in host]
    shards = sum(len(a.addressable_shards) for a in put)
    assert (shards == 0) == (jax.process_index() == 1), shards
    print(f"process {jax.process_index()} work leaves {len(put)} addressable shards {shards}")
    """
)


def test_round_work_device_put_on_a_process_without_mesh_devices(tmp_path):
    """A process that holds none of the mesh's devices still builds the global work arrays (each
    leaf's dtype comes from its host copy, not from a shard it does not have)."""
    script = tmp_path / "no_shards.py"
    script.write_text(_NO_SHARDS)
    coordinator = f"127.0.0.1:{_free_port()}"
    env = _env()
    results = _run_together([[sys.executable, str(script), coordinator, str(i)] for i in range(2)], env)
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stderr[-3000:]}"
        assert re.search(rf"process {i} work leaves \d+ addressable shards", r.stdout), r.stdout[-2000:]
    assert "addressable shards 0" in results[1].stdout
