"""The shortest complete sharded step: a paged KV cache over a data x model device mesh.

Run on a CPU with 8 forced host devices (set before JAX starts, as below)::

    python examples/sharded_step.py                  # mesh data=2,model=4
    python examples/sharded_step.py data=8,model=1

Many hosts: start the same program on every process with ``--process-id I --num-processes N
--coordinator HOST:PORT``; each calls ``jax.distributed.initialize`` first, keeps the whole
(deterministic) host bookkeeping and computes on its own devices.  It prints a sha256 of the
attention outputs, equal on every process.  Two processes on one CPU host::

    python examples/sharded_step.py data=2,model=4 --process-id 0 --num-processes 2 --coordinator 127.0.0.1:1234 &
    python examples/sharded_step.py data=2,model=4 --process-id 1 --num-processes 2 --coordinator 127.0.0.1:1234

On a CPU each process forces ``--local-devices`` host devices, by default its share of the mesh
(mesh size / ``--num-processes``: 4 each above); ``XLA_FLAGS`` naming
``--xla_force_host_platform_device_count`` takes precedence.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from ninfer_kv.device import allocate_state


def main(argv=None) -> str:
    ap = argparse.ArgumentParser()
    ap.add_argument("mesh", nargs="?", default="data=2,model=4")
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--coordinator", default=None)
    ap.add_argument("--local-devices", type=int, default=None,
                    help="host devices each process forces on a CPU (default: mesh size / --num-processes)")
    args = ap.parse_args(argv)
    from ninfer_kv.schema.mesh_spec import MeshSpec  # no JAX backend starts here

    spec = MeshSpec.parse(args.mesh)
    processes = args.num_processes if args.process_id is not None else 1
    if args.local_devices is None:
        if processes < 1 or spec.size % processes:
            ap.error(f"mesh {spec} ({spec.size} devices) does not split evenly over --num-processes "
                     f"{args.num_processes}; pass --local-devices (host devices per process)")
        args.local_devices = spec.size // processes
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:  # before JAX starts (no effect on a GPU)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.local_devices}".strip()
    import jax
    import numpy as np

    if args.process_id is not None:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig
    from ninfer_kv.device.mesh import KVMesh
    from ninfer_kv.device.sharded_ops import sharded_apply_work, sharded_paged_append, sharded_paged_attention
    from ninfer_kv.planning import plan_kv_cache_mesh
    from ninfer_kv.store.sharded import ShardedKVStore

    mesh = KVMesh(spec)                                        # all processes' devices, data-major
    if not any(d.process_index == jax.process_index() for d in mesh.devices):
        sys.exit(f"process {jax.process_index()} has none of the {spec.size} devices of mesh {spec} (the first "
                 f"{spec.size} of {jax.device_count()}); give each process {spec.size // jax.process_count()} "
                 f"devices (--local-devices, or the GPUs it sees)")
    plan = plan_kv_cache_mesh(ModelKVConfig(num_layers=2, num_kv_heads=8, head_dim=64, profile="k8v4"), mesh,
                              max_context=512, max_concurrency=8, policy=ExplicitCapacity(kv_capacity=4096))
    store = ShardedKVStore(plan, mesh)                         # one host-only KVStore per data shard
    state = allocate_state(store)                             # planes P(None, data, model), tables P(data)
    layout = store.layout("main")                              # what one device holds: 8 / model heads

    @jax.jit
    def step(state, work, rows, positions, valid, q, k, v):
        state = sharded_apply_work(mesh, state, work)         # each shard's table rows / copies, per device
        for layer in range(2):
            state = sharded_paged_append(mesh, state, layer, layout, rows, positions, k, v, valid)
        out = sharded_paged_attention(mesh, q, state, 1, layout, rows, positions, positions + valid)
        return state, out

    # the caller's scheduler puts each sequence on a data shard; the same inputs on every process
    per_shard = [[store.activate(70 + 10 * d, 16, shard=d)] for d in range(mesh.data)]
    rows = store.batch_rows(per_shard, 1)                      # batch slot d -> a global row of shard d
    prompt = np.array([70 + 10 * d for d in range(mesh.data)])
    store.map(rows, prompt)                               # pages from each shard's own reservation
    work = store.take_work().device_put(mesh)                  # stacked per shard, global arrays
    rng = np.random.default_rng(0)
    b, t = mesh.data, int(prompt.max())
    q, k, v = (rng.standard_normal((b, t, h, 64)).astype(np.float32) for h in (16, 8, 8))
    state, out = step(state, work, rows, np.zeros(b, np.int32), prompt.astype(np.int32), q, k, v)
    store.commit(rows, prompt)                            # after the step succeeded
    store.require_synced(state)
    store.audit_invariants()
    full = jax.jit(lambda x: x, out_shardings=mesh.sharding(mesh.replicated_spec()))(out)
    digest = hashlib.sha256(np.asarray(full.addressable_data(0)).tobytes()).hexdigest()
    tables = hashlib.sha256(store.host_block_table().tobytes()).hexdigest()[:16]  # page IDs of every shard
    line = f"mesh {mesh.spec} process {jax.process_index()}/{jax.process_count()} tables {tables} digest {digest}\n"
    sys.stdout.write(line)  # one write: JAX's own threads may print ([Gloo] lines) at the same time
    sys.stdout.flush()
    return digest


if __name__ == "__main__":
    main()
