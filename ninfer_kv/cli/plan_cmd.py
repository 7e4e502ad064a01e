"""``ninfer-kv plan``: resolve Main capacity M, every pool's pages and bytes, and the capacity curve B(M).

The capacity policy is explicit (``--kv-capacity``) or automatic (``--free-bytes``, ``--headroom-bytes``);
``--backend`` adds the MTP or Draft Full pool, and ``--mesh data=D,model=T`` plans per device over a mesh.
"""

from __future__ import annotations

import argparse

from ..units import describe_bytes, format_bytes
from .registry import CommandOutput, register_subcommand
from .tables import kv_lines, render_table
from .tables import thousands as _n
from .types import BACKEND, BYTES, MESH, NON_NEGATIVE_INT, POSITIVE_INT, add_profile

__all__ = ["configure", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    """Declare the ``plan`` arguments: model, engine, capacity policy, speculative backend and mesh."""
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=POSITIVE_INT, required=True, metavar="N", help="full-attention layers")
    model.add_argument("--kv-heads", type=POSITIVE_INT, required=True, metavar="H", help="KV heads")
    model.add_argument("--head-dim", type=POSITIVE_INT, required=True, metavar="D", help="head dim")
    add_profile(model)
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-context", type=POSITIVE_INT, required=True, metavar="S", help="per-sequence ceiling S")
    engine.add_argument("--max-concurrency", type=POSITIVE_INT, required=True, metavar="C", help="active rows C")
    cap = p.add_argument_group("capacity policy (exactly one of --kv-capacity and --free-bytes)")
    policy = cap.add_mutually_exclusive_group(required=True)
    policy.add_argument("--kv-capacity", type=POSITIVE_INT, metavar="TOKENS", help="explicit Main capacity in tokens")
    policy.add_argument("--free-bytes", type=BYTES, metavar="F", help="automatic policy: free device bytes F")
    cap.add_argument("--headroom-bytes", type=BYTES, metavar="R", help="automatic policy: headroom R (default 0)")
    cap.add_argument(
        "--fixed-bytes", type=BYTES, default=0, metavar="X", help="fixed device bytes inside B(M) (default 0)"
    )
    spec = p.add_argument_group("speculative backend")
    spec.add_argument("--backend", type=BACKEND, default="off", help="off (default), mtp, dflash, dflash2")
    spec.add_argument("--draft-window", type=POSITIVE_INT, metavar="K", help="MTP draft window K (default 1)")
    spec.add_argument("--mtp-layers", type=POSITIVE_INT, metavar="N", help="MTP layers (default 1)")
    spec.add_argument(
        "--draft-full-layers", type=NON_NEGATIVE_INT, metavar="N", help="DFlash full-attention layers (default 0)"
    )
    spec.add_argument("--draft-kv-heads", type=POSITIVE_INT, metavar="H", help="Draft Full KV heads (default --kv-heads)")
    spec.add_argument("--draft-head-dim", type=POSITIVE_INT, metavar="D", help="Draft Full head dim (default --head-dim)")
    mesh = p.add_argument_group("device mesh")
    mesh.add_argument(
        "--mesh", type=MESH, metavar="data=D,model=T",
        help="plan per device over a D x T mesh (KV heads over model, rows and pages over data); "
        "--max-concurrency and --kv-capacity are totals, --free-bytes and --fixed-bytes per device",
    )


_MTP_FLAGS = ("draft_window", "mtp_layers")
_DFLASH_FLAGS = ("draft_full_layers", "draft_kv_heads", "draft_head_dim")


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _speculative_from_args(args: argparse.Namespace):
    from ..kinds import SpeculativeBackend
    from ..planning import SpeculativeConfig

    backend = args.backend
    allowed = {
        SpeculativeBackend.OFF: (),
        SpeculativeBackend.MTP: _MTP_FLAGS,
        SpeculativeBackend.DFLASH: _DFLASH_FLAGS,
        SpeculativeBackend.DFLASH2: _DFLASH_FLAGS,
    }[backend]
    for attr in _MTP_FLAGS + _DFLASH_FLAGS:
        if getattr(args, attr) is not None and attr not in allowed:
            owner = "--backend mtp" if attr in _MTP_FLAGS else "--backend dflash or dflash2"
            raise ValueError(f"{_flag(attr)} applies only to {owner}; got --backend {backend.value}")
    return SpeculativeConfig(
        backend=backend,
        draft_window=args.draft_window if args.draft_window is not None else 1,
        mtp_layers=args.mtp_layers if args.mtp_layers is not None else 1,
        draft_full_layers=args.draft_full_layers or 0,
        draft_kv_heads=args.draft_kv_heads,
        draft_head_dim=args.draft_head_dim,
    )


def _dflash_note(speculative) -> str | None:
    if speculative.backend.value in ("dflash", "dflash2") and not speculative.has_draft_full:
        return (
            f"--backend {speculative.backend.value} without --draft-full-layers plans no Draft Full pool "
            "(the draft model then keeps no paged KV here); pass --draft-full-layers N to plan one"
        )
    return None


def run(args: argparse.Namespace) -> CommandOutput:
    """Plan the pools for the parsed flags (over a mesh with ``--mesh``); text view and ``--json`` object."""
    from ..planning import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, plan_kv_cache

    speculative = _speculative_from_args(args)
    if args.kv_capacity is not None:
        if args.headroom_bytes is not None:
            raise ValueError("--headroom-bytes applies only to the automatic policy (--free-bytes)")
        policy = ExplicitCapacity(args.kv_capacity)
        policy_json = {"kind": "explicit", "kv_capacity": args.kv_capacity}
    else:
        policy = AutomaticCapacity(free_bytes=args.free_bytes, headroom_bytes=args.headroom_bytes or 0)
        policy_json = {"kind": "automatic", "free_bytes": policy.free_bytes, "headroom_bytes": policy.headroom_bytes}
    model = ModelKVConfig(args.layers, args.kv_heads, args.head_dim, args.profile)
    if args.mesh is not None:
        return _run_mesh_plan(args, model, policy, policy_json, speculative)
    plan = plan_kv_cache(
        model,
        max_context=args.max_context,
        max_concurrency=args.max_concurrency,
        policy=policy,
        speculative=speculative,
        fixed_bytes=args.fixed_bytes,
    )
    data = plan.to_json()
    data["policy"] = policy_json
    if speculative.backend.value == "mtp":
        data["draft_window"] = speculative.draft_window
    note = _dflash_note(speculative)
    data["notes"] = [note] if note else []
    return CommandOutput(data=data, text=_plan_text(plan, speculative, policy_json))


def _run_mesh_plan(args, model, policy, policy_json: dict, speculative) -> CommandOutput:
    from ..planning import plan_kv_cache_mesh

    mp = plan_kv_cache_mesh(model, args.mesh, max_context=args.max_context, max_concurrency=args.max_concurrency,
                            policy=policy, speculative=speculative, fixed_bytes=args.fixed_bytes)
    data = mp.to_json() | {"policy": policy_json}
    dev = mp.device
    per_device = _plan_text(dev, dev.builder.speculative, _local_policy_json(policy_json, mp))
    spec = mp.mesh
    lines = ["KV plan over a device mesh"]
    heads = mp.device.pools[next(iter(mp.device.pools))].layout.num_kv_heads
    rep = mp.head_replication
    head_text = f"{model.num_kv_heads} / {spec.model} = {heads} per device" if rep == 1 else (
        f"{model.num_kv_heads} < {spec.model}: each head stored {rep} times, {heads} per device "
        f"(the planes cost {rep}x the unreplicated cache)")
    single = mp.single_device_bytes
    lines += kv_lines([
        ("mesh", f"{spec} ({spec.size} devices)"),
        ("KV heads", head_text),
        ("rows", f"C = {_n(mp.max_concurrency)} = {spec.data} data shard(s) x {_n(dev.max_concurrency)} rows"),
        ("Main pages", f"{_n(mp.m_local)} per data shard (own page IDs), {_n(mp.m_local * spec.data)} in total"),
        ("Main capacity", f"{_n(mp.capacity_tokens)} tokens over the mesh"),
        ("per device", describe_bytes(mp.device_bytes)),
        ("total", f"{describe_bytes(mp.total_bytes)} = {spec.size} devices x per device"),
        ("one device", "beyond a single device's bounds" if single is None else
         f"{describe_bytes(single)} for the same capacity unsharded (per device / one device = "
         f"{mp.device_bytes / single:.4f})"),
    ])
    lines += ["", "per device (one data shard's rows and pages, this device's heads)", "", per_device]
    return CommandOutput(data=data, text="\n".join(lines))


def _local_policy_json(policy_json: dict, mp) -> dict:
    if policy_json["kind"] == "explicit":
        return {"kind": "explicit", "kv_capacity": mp.device.capacity_tokens}
    return policy_json


def _plan_text(plan, speculative, policy_json: dict) -> str:
    from ..geometry import PAGE_SIZE as P
    from ..kinds import PoolKind

    b = plan.builder
    backend = speculative.backend.value
    if backend == "mtp":
        lead = b.physical_pages(PoolKind.MTP, plan.m) - plan.m
        backend += (
            f" (draft window K = {speculative.draft_window}, {speculative.mtp_layers} MTP layer(s); "
            f"MTP pages = M + C*ceil((K-1)/P) = M + {_n(lead)})"
        )
    elif speculative.has_draft_full:
        backend += f" ({speculative.draft_full_layers} draft full-attention layer(s))"
    elif backend in ("dflash", "dflash2"):
        backend += " (no draft full-attention layers: no Draft Full pool planned)"
    where = "M_min" if plan.m == b.m_min else ("M_max" if plan.m == b.m_max else "between M_min and M_max")
    lines = ["KV plan"]
    lines += kv_lines(
        [
            ("page size P", f"{P} tokens"),
            ("max context S", f"{_n(b.max_context)} tokens (L = ceil(S/P) = {_n(b.logical_pages)} logical pages)"),
            ("max concurrency C", _n(b.max_concurrency)),
            ("backend", backend),
            ("Main range", f"M_min = max(L, C) = {_n(b.m_min)}  ..  M_max = C*L = {_n(b.m_max)} page groups"),
            ("Main pages M", f"{_n(plan.m)} ({where})"),
            (
                "Main capacity",
                f"{_n(plan.capacity_tokens)} tokens = {_n(plan.m)} pages x {P} "
                f"(per-sequence ceiling stays S = {_n(b.max_context)})",
            ),
        ]
    )
    rows = []
    for kind, pool in plan.pools.items():
        lay = pool.layout
        rows.append(
            [
                kind.value,
                lay.profile.value,
                lay.order.value,
                lay.num_layers,
                lay.num_kv_heads,
                lay.head_dim,
                _n(pool.physical_pages),
                format_bytes(pool.page_bytes),
                format_bytes(pool.bytes),
                f"{pool.table_shape[0]}x{pool.table_shape[1]} ({format_bytes(pool.table_bytes)})",
            ]
        )
    lines += [
        "",
        "pools",
        render_table(
            ["pool", "profile", "order", "layers", "kv_heads", "head_dim", "pages", "page bytes", "bytes", "block table"],
            rows,
            right=(3, 4, 5, 6, 7, 8),
        ),
    ]
    curve = plan.curve
    lines += ["", "capacity curve  B(M) = B_min + (M - M_min) * B_step"]
    pairs = [
        ("B_min", f"{describe_bytes(curve.b_min)} at M_min = {_n(curve.m_min)}"),
        ("B_step", f"{describe_bytes(curve.b_step)} per Main page group"),
        ("fixed part", describe_bytes(b.fixed_bytes)),
        ("B(M)", f"{describe_bytes(plan.device_bytes)} device bytes at M = {_n(plan.m)}"),
    ]
    if policy_json["kind"] == "automatic":
        F, R = policy_json["free_bytes"], policy_json["headroom_bytes"]
        left = F - R - plan.device_bytes
        pairs += [
            ("policy", "automatic: M = min(M_max, M_min + floor((F - R - B_min) / B_step))"),
            ("free F", describe_bytes(F)),
            ("headroom R", describe_bytes(R)),
            ("F - R - B(M)", f"{describe_bytes(left)} left unreserved"),
        ]
    else:
        pairs += [("policy", f"explicit: kv_capacity = {_n(policy_json['kv_capacity'])} tokens, M = ceil(K/P)")]
    lines += kv_lines(pairs)
    note = _dflash_note(speculative)
    if note:
        lines += ["", f"note: {note}"]
    return "\n".join(lines)


register_subcommand(
    "plan",
    help="resolve Main capacity M, every pool's pages and bytes, and the capacity curve B(M)",
    configure=configure,
    run=run,
)
