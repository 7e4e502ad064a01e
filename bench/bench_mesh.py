"""Decode step over a device mesh versus one device doing the same lanes, in one run.

    python bench/bench_mesh.py [--mesh data=2,model=4] [--batch 16] [--context 1024] [--steps 20]

Forces 8 host devices before JAX starts (on a CPU).  One mesh step serves every data shard's lanes
together (``--batch`` = ``D * C_local`` tokens per step, as the engine's lockstep rounds do); both
programs decode one token for every sequence in every layer (append + attention through the FFI kernels), with the same total batch,
heads and context: the sharded one per device inside ``shard_map``, the single-device one on device
0 over the whole cache.  Also prints the per-device bytes of the mesh plan next to the bytes of one
device holding the same cache.

On a CPU the 8 "devices" are threads of one process sharing the machine's cores, so the ratio
measures what partitioning costs or saves in dispatch and per-call overhead on the same cores, not
a multi-accelerator speedup: with fewer cores than devices it is expected near or below 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from ninfer_kv.ops.views import allocate_planes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="data=2,model=4")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--profile", default="k8v4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--impl", default="ffi")
    args = ap.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ninfer_kv import ops
    from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig
    from ninfer_kv.ops.views import PagedKVBatchLayerView
    from ninfer_kv.device.mesh import KVMesh
    from ninfer_kv.device.sharded_ops import sharded_paged_append, sharded_paged_attention
    from ninfer_kv.device.state import KVDeviceState
    from ninfer_kv.schema.geometry import PAGE_SIZE, ceil_div
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.planning import plan_kv_cache_mesh
    from ninfer_kv.schema.kinds import PoolKind

    mesh = KVMesh(args.mesh)
    dd, hh = mesh.data, args.kv_heads
    logical = ceil_div(args.context + args.steps + 1, PAGE_SIZE)
    model = ModelKVConfig(args.layers, hh, args.head_dim, args.profile)
    plan = plan_kv_cache_mesh(model, mesh, max_context=logical * PAGE_SIZE, max_concurrency=args.batch,
                              policy=ExplicitCapacity(args.batch * logical * PAGE_SIZE))
    kind = PoolKind.MAIN
    lay_dev = plan.device.pools[kind].layout
    lay_shard = plan.shard.pools[kind].layout
    n_local = plan.shard.pools[kind].physical_pages
    c_local = args.batch // dd
    rng = np.random.default_rng(0)
    # each shard's rows own disjoint random pages of that shard
    tables_local = np.stack([rng.permutation(n_local)[: c_local * logical].reshape(c_local, logical) for _ in range(dd)])
    tables_single = tables_local + (np.arange(dd) * n_local)[:, None, None]
    tables_local = tables_local.reshape(args.batch, logical).astype(np.int32)
    tables_single = tables_single.reshape(args.batch, logical).astype(np.int32)
    planes = allocate_planes(lay_shard, dd * n_local)
    state = KVDeviceState({kind: planes}, {kind: jnp.asarray(tables_local)}, jnp.zeros((), jnp.int32),
                          ((kind, lay_shard),))
    state = jax.device_put(state, mesh.state_shardings(state))
    rows = np.arange(args.batch, dtype=np.int32)
    hq = 4 * max(hh, mesh.model)
    q = rng.standard_normal((args.batch, 1, hq, args.head_dim)).astype(np.float32)
    k = rng.standard_normal((args.batch, 1, hh, args.head_dim)).astype(np.float32)
    one = np.ones(args.batch, np.int32)

    # Each layer's attention output feeds the next layer's K/V, as in a model.  Without that
    # dependency XLA may order a layer's in-place append before the previous layer's attention
    # read, and must then copy the whole planes to keep that read intact.
    def next_kv(x, out):
        return x + out[:, :, : x.shape[2]].astype(x.dtype)

    def sharded(state, pos):
        x = k
        for layer in range(args.layers):
            state = sharded_paged_append(mesh, state, layer, lay_dev, rows, pos, x, x, one, impl=args.impl)
            out = sharded_paged_attention(mesh, q, state, layer, lay_dev, rows, pos, pos + 1, impl=args.impl)
            x = next_kv(x, out)
        return state, out

    dev0 = jax.devices()[0]
    lay_single = PagedKVStorageLayout(args.profile, args.layers, hh, args.head_dim)
    single_planes = jax.device_put(allocate_planes(lay_single, dd * n_local), dev0)
    single_tab = jax.device_put(jnp.asarray(tables_single), dev0)

    def single(planes, pos):
        x = k
        for layer in range(args.layers):
            view = PagedKVBatchLayerView(planes, single_tab, layer, lay_single)
            view = ops.paged_append(view, rows, pos, x, x, one, impl=args.impl)
            planes = view.planes
            out = ops.paged_attention(q, view, rows, pos, pos + 1, impl=args.impl)
            x = next_kv(x, out)
        return planes, out

    f_sharded = jax.jit(sharded, donate_argnums=0)
    f_single = jax.jit(single, donate_argnums=0)
    pos_spec = np.full(args.batch, args.context, np.int32)
    for name, fn, carry in (("one device", f_single, single_planes), ("mesh", f_sharded, state)):
        hlo = fn.lower(carry, pos_spec).compile().as_text()
        copies = sum(1 for line in hlo.splitlines() if " copy(" in line and "[" in line)
        print(f"  {name}: {copies} copy instructions in the compiled step")
    pos0 = np.full(args.batch, args.context, np.int32)

    # interleaved: each round times one step of each program, so load from elsewhere on the
    # machine hits both alike; medians over the rounds
    carries = {"single": single_planes, "sharded": state}
    fns = {"single": f_single, "sharded": f_sharded}
    times = {"single": [], "sharded": []}
    for name in fns:  # compile and warm up
        carries[name], out = fns[name](carries[name], pos0)
        jax.block_until_ready(out)
    for s in range(args.steps):
        for name in fns:
            t0 = time.perf_counter()
            carries[name], out = fns[name](carries[name], pos0 + 1 + s)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
    t_single, t_sharded = (float(np.median(times[n])) for n in ("single", "sharded"))
    print(f"decode step, {args.layers} layers x (append + attention), batch {args.batch}, context {args.context}, "
          f"{hh} KV heads, {hq} query heads, D={args.head_dim}, {args.profile}, impl={args.impl}")
    print(f"  tokens per step     {args.batch:9d}  (mesh: {c_local} lanes of each of {dd} data shards, one step)")
    print(f"  one device          {t_single * 1e3:9.3f} ms/step  {args.batch / t_single:9.0f} tokens/s")
    print(f"  mesh {str(mesh.spec):<14} {t_sharded * 1e3:9.3f} ms/step  {args.batch / t_sharded:9.0f} tokens/s  "
          f"({mesh.spec.size} devices)")
    print(f"  one device / mesh   {t_single / t_sharded:9.3f}x")
    print(f"plan bytes (max_context {logical * PAGE_SIZE}, C = {args.batch}):")
    print(f"  per device          {plan.device_bytes:>14,} B")
    print(f"  one device          {plan.single_device_bytes:>14,} B")
    print(f"  per device / one    {plan.device_bytes / plan.single_device_bytes:9.4f}  "
          f"(planes / {mesh.spec.size}; each device also holds its data shard's block table)")


if __name__ == "__main__":
    main()
