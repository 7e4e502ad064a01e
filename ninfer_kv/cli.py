"""The ``ninfer-kv`` command line.

Usage::

    ninfer-kv layout --profile k8v4 --head-dim 256 [--layers 16 --kv-heads 2 [--order page-major] [--pages 8]] [--json]
    ninfer-kv plan --layers 16 --kv-heads 2 --head-dim 256 --profile k8v4 \\
        --max-context 32768 --max-concurrency 64 --free-bytes 40GiB --backend mtp --draft-window 4 [--json]

Output contract:

* Default output is human-readable text.  With ``--json`` exactly one JSON object is written to
  stdout and nothing else.
* Bad values exit with status 2 and a single line on stderr that names the flag (``--max-context``,
  never the library's ``max_context``), the value and the allowed range, and says when the value is
  a default the user did not type.  No traceback is ever printed: an unexpected failure is one line
  and exit status 1 (``NINFER_KV_TRACEBACK=1`` shows the traceback).
* ``--kv-cache-dtype`` is an alias of ``--profile``; both accept the profile names and the short
  names of :data:`ninfer_kv.profiles.PROFILE_ALIASES` (``fp8``, ``int8``, ``nvfp4``, ...), exactly
  as Python's ``KVProfile.parse`` does.  Byte sizes are read by :func:`ninfer_kv.units.parse_bytes`,
  the syntax every Python byte-count argument accepts too.

Subcommands live in a registry.  A module adds one with :func:`register_subcommand` (usually as a
decorator on its ``run`` function) and is listed in :data:`SUBCOMMAND_MODULES` so ``main`` imports it
before building the parser::

    from ninfer_kv.cli import CommandOutput, register_subcommand

    def _configure(parser):
        parser.add_argument("--steps", type=int, default=10)

    @register_subcommand("demo", help="run a small decode loop", configure=_configure)
    def _run(args) -> CommandOutput:
        ...
        return CommandOutput(data={"steps": args.steps}, text=f"ran {args.steps} steps")

``run`` receives the parsed namespace and returns a :class:`CommandOutput` (rendered as text or as
JSON by ``--json``) or ``None`` when it has written its own output.  A ``ValueError`` raised by
``run`` is reported as a usage error (exit 2, one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
from typing import Callable, Sequence

from .profiles import PROFILE_ALIASES, KVProfile, profile_names
from .units import BYTE_SIZE_FORMS, describe_bytes, format_bytes, parse_bytes

__all__ = [
    "CommandOutput",
    "Subcommand",
    "SUBCOMMAND_MODULES",
    "register_subcommand",
    "registered_subcommands",
    "build_parser",
    "parse_bytes",
    "format_bytes",
    "bounded_int",
    "render_table",
    "main",
]

PROG = "ninfer-kv"
EXIT_USAGE = 2
EXIT_INTERNAL = 1
_MAX_DIGITS = 60

SUBCOMMAND_MODULES: tuple[str, ...] = ("ninfer_kv.demo.cli",)
"""Dotted names of modules that register further subcommands when imported (besides the built-ins)."""


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CommandOutput:
    """What a subcommand produced: ``data`` for ``--json`` and ``text`` for the default view."""

    data: dict
    text: str


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One registered subcommand.

    Attributes:
      name: the subcommand word on the command line.
      help: one-line description shown by ``ninfer-kv --help``.
      configure: adds the subcommand's arguments to its ``argparse`` parser (``--json`` is added by
        the registry for every subcommand).
      run: executes the parsed namespace; returns a :class:`CommandOutput` or ``None``.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], "CommandOutput | None"]


_REGISTRY: dict[str, Subcommand] = {}


def register_subcommand(
    name: str,
    *,
    help: str,
    configure: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], "CommandOutput | None"] | None = None,
):
    """Register a subcommand; usable directly (pass ``run``) or as a decorator on ``run``.

    Names are unique: registering a taken name raises ``ValueError`` and leaves the registry unchanged.
    """
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name or ""):
        raise ValueError(f"subcommand name {name!r} is invalid; use lowercase letters, digits and '-'")

    def _register(fn):
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise ValueError(f"subcommand {name!r} is already registered")
        _REGISTRY[name] = Subcommand(name=name, help=help, configure=configure, run=fn)
        return fn

    if run is not None:
        return _register(run)
    return _register


def registered_subcommands() -> dict[str, Subcommand]:
    """A copy of the registry (built-ins plus everything imported from :data:`SUBCOMMAND_MODULES`)."""
    _load_subcommand_modules()
    return dict(_REGISTRY)


def _load_subcommand_modules() -> None:
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module)


# ------------------------------------------------------------------------------------------------
# Argument parsing with one-line errors
# ------------------------------------------------------------------------------------------------
class UsageError(Exception):
    """A bad command line or a bad value: reported as one line on stderr, exit status 2."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog
        self.message = message

    def line(self) -> str:
        return f"{self.prog}: error: {_one_line(self.message)}"


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are a single line (no usage block) and never exit directly."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(self.prog, message)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered subcommand."""
    from . import __version__

    parser = _Parser(
        prog=PROG,
        description="Plan and inspect ninfer_kv's growing paged KV cache.",
        epilog=f"Byte sizes accept {BYTE_SIZE_FORMS}.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in registered_subcommands().values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        _add_common_arguments(p)
        p.set_defaults(_subcommand=cmd, _parser=p)
    return parser


# ------------------------------------------------------------------------------------------------
# Value parsers (argparse ``type=`` callables)
# ------------------------------------------------------------------------------------------------
def _arg_type(name: str, fn):
    """Wrap a converter so argparse reports its ``ValueError`` message verbatim."""

    def convert(text):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        digits = str(text).strip()
        if len(digits.lstrip("+-")) > _MAX_DIGITS and digits.lstrip("+-").isdigit():
            raise ValueError(f"{digits[:12]}... ({len(digits)} digits) is too large; it must be {allowed}")
        try:
            value = int(digits, 10)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer; it must be {allowed}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"{value} is out of range; it must be {allowed}")
        return value

    return _arg_type("int", parse)


def bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse ``type=`` for integers in ``[minimum, maximum]`` (one-line errors naming the range)."""
    return _int_at_least(minimum, maximum)


KV_CACHE_DTYPES = PROFILE_ALIASES
"""The ``--kv-cache-dtype`` short names: the one table of :data:`ninfer_kv.profiles.PROFILE_ALIASES`."""

PROFILE_HELP = f"KV profile: {profile_names()}"


def _order(text: str):
    from .geometry import PlaneOrder

    return PlaneOrder.parse(text)


def _backend(text: str):
    from .planning import SpeculativeBackend

    return SpeculativeBackend.parse(text)


POSITIVE_INT = _int_at_least(1)
NON_NEGATIVE_INT = _int_at_least(0)
BYTES = _arg_type("bytes", parse_bytes)
PROFILE = _arg_type("profile", KVProfile.parse)
ORDER = _arg_type("order", _order)
BACKEND = _arg_type("backend", _backend)


# ------------------------------------------------------------------------------------------------
# Table rendering
# ------------------------------------------------------------------------------------------------
def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """Render an aligned plain-text table; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row):
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def _n(x: int) -> str:
    return f"{int(x):,}"


def _kv_lines(pairs: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"  {k.ljust(width)}  {v}" for k, v in pairs]


# ------------------------------------------------------------------------------------------------
# layout
# ------------------------------------------------------------------------------------------------
def _add_profile(p) -> None:
    p.add_argument("--profile", "--kv-cache-dtype", dest="profile", type=PROFILE, required=True, help=PROFILE_HELP)


def _configure_layout(p: argparse.ArgumentParser) -> None:
    _add_profile(p)
    p.add_argument("--head-dim", type=POSITIVE_INT, required=True, metavar="D", help="head dim D")
    pool = p.add_argument_group("pool (optional; shows page bytes and stacked plane shapes)")
    pool.add_argument("--layers", type=POSITIVE_INT, metavar="N", help="layers stacked in the pool")
    pool.add_argument("--kv-heads", type=POSITIVE_INT, metavar="H", help="KV heads")
    pool.add_argument("--order", type=ORDER, metavar="ORDER", help="page-major (default) or head-major")
    pool.add_argument("--pages", type=POSITIVE_INT, metavar="N", help="physical page groups for shapes (default 1)")


def _run_layout(args: argparse.Namespace) -> CommandOutput:
    from .layout import PagedKVStorageLayout
    from .planning import ModelKVConfig, check_pool_bytes

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
            f"P = {layout.page_size}, N = {pages} page group(s)",
            render_table(
                ["plane", "dtype", "stacked shape", "page bytes", "bytes"],
                [[p.name, p.dtype, str(p.shape), _n(p.page_bytes), _n(p.bytes)] for p in summary.planes],
                right=(3, 4),
            ),
            f"PageBytes = {describe_bytes(layout.page_bytes)} per page group; "
            f"{_n(layout.bytes_per_token)} B per token",
        ]
    return CommandOutput(data=data, text="\n".join(lines))


register_subcommand(
    "layout",
    help="show a profile's plane schema and bytes per token-head (and a pool's page bytes and plane shapes)",
    configure=_configure_layout,
    run=_run_layout,
)


# ------------------------------------------------------------------------------------------------
# plan
# ------------------------------------------------------------------------------------------------
def _configure_plan(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=POSITIVE_INT, required=True, metavar="N", help="full-attention layers")
    model.add_argument("--kv-heads", type=POSITIVE_INT, required=True, metavar="H", help="KV heads")
    model.add_argument("--head-dim", type=POSITIVE_INT, required=True, metavar="D", help="head dim")
    _add_profile(model)
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
        "--mesh", type=_arg_type("mesh", _mesh), metavar="data=D,model=T",
        help="plan per device over a D x T mesh (KV heads over model, rows and pages over data); "
        "--max-concurrency and --kv-capacity are totals, --free-bytes and --fixed-bytes per device",
    )


def _mesh(text: str):
    from .mesh import MeshSpec

    return MeshSpec.parse(text)


_MTP_FLAGS = ("draft_window", "mtp_layers")
_DFLASH_FLAGS = ("draft_full_layers", "draft_kv_heads", "draft_head_dim")


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _speculative_from_args(args: argparse.Namespace):
    from .planning import SpeculativeBackend, SpeculativeConfig

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


def _run_plan(args: argparse.Namespace) -> CommandOutput:
    from .planning import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, plan_kv_cache

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
    from .planning import plan_kv_cache_mesh

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
    lines += _kv_lines([
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
    from .geometry import PAGE_SIZE as P
    from .planning import PoolKind

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
    lines += _kv_lines(
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
    lines += _kv_lines(pairs)
    note = _dflash_note(speculative)
    if note:
        lines += ["", f"note: {note}"]
    return "\n".join(lines)


register_subcommand(
    "plan",
    help="resolve Main capacity M, every pool's pages and bytes, and the capacity curve B(M)",
    configure=_configure_plan,
    run=_run_plan,
)


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------
PARAMETER_FLAGS: dict[str, str] = {
    "num_layers": "--layers",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "num_pages": "--pages",
    "profile": "--profile",
    "max_context": "--max-context",
    "max_concurrency": "--max-concurrency",
    "kv_capacity": "--kv-capacity",
    "free_bytes": "--free-bytes",
    "headroom_bytes": "--headroom-bytes",
    "fixed_bytes": "--fixed-bytes",
    "draft_window": "--draft-window",
    "mtp_layers": "--mtp-layers",
    "draft_full_layers": "--draft-full-layers",
    "draft_kv_heads": "--draft-kv-heads",
    "draft_head_dim": "--draft-head-dim",
    "mesh": "--mesh",
}
"""Library parameter names and the flags that set them (errors from the library speak in flags)."""

_PARAMETER_RE = re.compile(
    r"\b(" + "|".join(sorted(PARAMETER_FLAGS, key=len, reverse=True)) + r")\b(?:=('[^']*'|[^\s,;)]+))?"
)


def _typed_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The option strings the user typed (``--flag``, ``--flag=value`` or an unambiguous prefix)."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    typed = set()
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        hits = [o for o in options if o == name] or [o for o in options if o.startswith(name)]
        if len(hits) == 1:
            typed.add(hits[0])
    return typed


def _speak_in_flags(message: str, parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """Rewrite library parameter names as flags; mark the first mention of each flag not typed."""
    canonical = {o: a.option_strings[0] for a in parser._actions for o in a.option_strings}
    typed = {canonical[o] for o in _typed_flags(parser, argv)}
    marked: set[str] = set()

    def flag(match: re.Match) -> str:
        name = PARAMETER_FLAGS[match.group(1)]
        text = name if match.group(2) is None else f"{name} {match.group(2)}"
        if name in typed or name in marked or name not in canonical:
            return text
        marked.add(name)
        return f"{text} (the default; not on the command line)"

    return _PARAMETER_RE.sub(flag, message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 success, 2 bad usage or bad value, 1 internal error).

    No traceback is printed: a bad value is one line on stderr naming the flag, the value and the
    allowed range; an unexpected failure is one line too (set ``NINFER_KV_TRACEBACK=1`` to see it).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: Subcommand | None = None
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            cmd = getattr(args, "_subcommand", None)
            if cmd is None:
                names = ", ".join(registered_subcommands())
                raise UsageError(PROG, f"a command is required (choose from {names}); see {PROG} --help")
            try:
                result = cmd.run(args)
            except ValueError as exc:
                message = _speak_in_flags(str(exc), args._parser, argv)
                raise UsageError(f"{PROG} {cmd.name}", message) from None
        except UsageError as exc:
            print(exc.line(), file=sys.stderr)
            return EXIT_USAGE
        if result is not None:
            if args.json:
                sys.stdout.write(json.dumps(result.data) + "\n")
            else:
                sys.stdout.write(result.text.rstrip("\n") + "\n")
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``ninfer-kv plan ... | head``): stop quietly
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):
            pass
        return 0
    except Exception as exc:  # noqa: BLE001 - the command line never prints a traceback
        import os

        if os.environ.get("NINFER_KV_TRACEBACK"):
            raise
        where = f"{PROG} {cmd.name}" if cmd is not None else PROG
        print(
            f"{where}: internal error: {type(exc).__name__}: {_one_line(exc)} (set NINFER_KV_TRACEBACK=1 for details)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
