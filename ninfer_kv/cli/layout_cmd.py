"""``ninfer-kv layout``: a profile's plane schema and bytes per token-head (and a pool's page bytes and shapes)."""

from __future__ import annotations

import argparse

from ..schema.sizes import describe_bytes
from .registry import CommandOutput, register_subcommand
from .tables import render_table
from .tables import thousands as _n
from .types import ORDER, POSITIVE_INT, add_profile

__all__ = ["configure", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    """Declare the ``layout`` arguments: the profile and head dim, and the optional pool."""
    add_profile(p)
    p.add_argument("--head-dim", type=POSITIVE_INT, required=True, metavar="D", help="head dim D")
    pool = p.add_argument_group("pool (optional; shows page bytes and stacked plane shapes)")
    pool.add_argument("--layers", type=POSITIVE_INT, metavar="N", help="layers stacked in the pool")
    pool.add_argument("--kv-heads", type=POSITIVE_INT, metavar="H", help="KV heads")
    pool.add_argument("--order", type=ORDER, metavar="ORDER", help="page-major (default) or head-major")
    pool.add_argument("--pages", type=POSITIVE_INT, metavar="N", help="physical pages for shapes (default 1)")


def run(args: argparse.Namespace) -> CommandOutput:
    """The plane table of one (token, head); with ``--layers`` and ``--kv-heads`` also the pool's planes."""
    from ..schema.layout import PagedKVStorageLayout
    from ..planning import ModelKVConfig, check_pool_bytes

    profile, head_dim = args.profile, args.head_dim
    ModelKVConfig(args.layers or 1, args.kv_heads or 1, head_dim, profile)  # bounds and the profile's head dims
    planes = profile.planes(head_dim)
    data = {
        "profile": profile.value,
        "head_dim": head_dim,
        "planes": [p.to_json() for p in planes],
        "k_bytes": profile.tensor_bytes("k", head_dim),
        "v_bytes": profile.tensor_bytes("v", head_dim),
        "token_head_bytes": profile.token_head_bytes(head_dim),
    }
    lines = [
        f"profile {profile.value}, head_dim {head_dim}: planes of one (token, head)",
        render_table(
            ["plane", "role", "dtype", "X", "group", "bytes"],
            [[p.name, p.role, p.dtype_name, p.extent, p.group, p.token_head_bytes] for p in planes],
            right=(3, 4, 5),
        ),
        f"K {data['k_bytes']} B + V {data['v_bytes']} B = {data['token_head_bytes']} B per token-head",
    ]

    pool_flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--order": args.order, "--pages": args.pages}
    if any(v is not None for v in pool_flags.values()):
        missing = [k for k in ("--layers", "--kv-heads") if pool_flags[k] is None]
        if missing:
            given = ", ".join(k for k, v in pool_flags.items() if v is not None)
            raise ValueError(f"{given} needs {' and '.join(missing)} as well (the pool view needs layers and KV heads)")
        layout = PagedKVStorageLayout(profile, args.layers, args.kv_heads, head_dim, order=args.order or "page-major")
        pages = args.pages or 1
        check_pool_bytes(layout, pages)
        summary = layout.memory_summary(pages)
        data["pool"] = {
            "layers": layout.num_layers,
            "kv_heads": layout.num_kv_heads,
            "order": layout.order.value,
            "page_size": layout.page_size,
            "page_bytes": layout.page_bytes,
            "bytes_per_token": layout.bytes_per_token,
            "pages": pages,
            "bytes": summary.bytes,
            "planes": [p.to_json() for p in summary.planes],
        }
        axes = "(layers, N, H, P, X)" if layout.order.value == "page-major" else "(layers, H, N, P, X)"
        lines += [
            "",
            f"pool: {layout.num_layers} layers x {layout.num_kv_heads} KV heads, {layout.order.value} {axes}, "
            f"P = {layout.page_size}, N = {pages} page(s)",
            render_table(
                ["plane", "dtype", "stacked shape", "page bytes", "bytes"],
                [[p.name, p.dtype, str(p.shape), _n(p.page_bytes), _n(p.bytes)] for p in summary.planes],
                right=(3, 4),
            ),
            f"PageBytes = {describe_bytes(layout.page_bytes)} per page; "
            f"{_n(layout.bytes_per_token)} B per token",
        ]
    return CommandOutput(data=data, text="\n".join(lines))


register_subcommand(
    "layout",
    help="show a profile's plane schema and bytes per token-head (and a pool's page bytes and plane shapes)",
    configure=configure,
    run=run,
)
