"""``ninfer-kv plan``: resolve Main capacity M, every pool's pages and bytes, and the capacity curve B(M).

The model is given by its numbers (``--layers``, ``--kv-heads``, ``--head-dim``) or read from a
Hugging Face checkpoint directory (``--model DIR``: its ``config.json`` only, no weights; the layers,
KV heads and head dim come from there and ``--max-context`` defaults to its
``max_position_embeddings``).  The capacity policy is explicit (``--kv-capacity``) or automatic
(``--free-bytes``, ``--headroom-bytes``); ``--speculative`` adds the MTP or Draft Full pool, and
``--mesh data=D,model=T`` plans per device over a mesh.  ``--max-model-len`` and ``--max-num-seqs``
are aliases of ``--max-context`` and ``--max-concurrency`` (vLLM's names).
"""

from __future__ import annotations

import argparse
import os
import re

from ..schema.sizes import describe_bytes, format_bytes
from .flags import speak_in_flags
from .parser import PROG, UsageError
from .registry import CommandOutput, register_subcommand
from .tables import kv_lines, render_table
from .tables import thousands as _n
from .types import SPECULATIVE, BYTES, MESH, NON_NEGATIVE_INT, POSITIVE_INT, add_profile

__all__ = ["configure", "run"]


def configure(p: argparse.ArgumentParser) -> None:
    """Declare the ``plan`` arguments: model, engine, capacity policy, speculative method and mesh."""
    model = p.add_argument_group("model (--model DIR, or --layers, --kv-heads and --head-dim)")
    model.add_argument(
        "--model", metavar="DIR",
        help="Hugging Face checkpoint directory: layers, KV heads and head dim from its config.json (no weights "
        "are read); --max-context defaults to its max_position_embeddings",
    )
    model.add_argument("--layers", type=POSITIVE_INT, metavar="N", help="full-attention layers")
    model.add_argument("--kv-heads", type=POSITIVE_INT, metavar="H", help="KV heads")
    model.add_argument("--head-dim", type=POSITIVE_INT, metavar="D", help="head dim")
    add_profile(model)
    rings = p.add_argument_group("sliding-window layers (per-row window rings; with --model: from its config.json)")
    rings.add_argument("--window-layers", type=POSITIVE_INT, metavar="N", help="sliding-window layers")
    rings.add_argument("--window", type=POSITIVE_INT, metavar="W", help="their window in tokens")
    rings.add_argument("--ring-step-tokens", type=POSITIVE_INT, metavar="T",
                       help="most tokens one step writes into a row (default 512); a ring holds W + T tokens")
    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--max-context", "--max-model-len", dest="max_context", type=POSITIVE_INT, metavar="S",
        help="per-sequence ceiling S (required without --model; default with it: the model's max_position_embeddings)",
    )
    engine.add_argument(
        "--max-concurrency", "--max-num-seqs", dest="max_concurrency", type=POSITIVE_INT, required=True, metavar="C",
        help="active rows C",
    )
    cap = p.add_argument_group("capacity policy (exactly one of --kv-capacity and --free-bytes)")
    policy = cap.add_mutually_exclusive_group(required=True)
    policy.add_argument("--kv-capacity", type=POSITIVE_INT, metavar="TOKENS", help="explicit Main capacity in tokens")
    policy.add_argument("--free-bytes", type=BYTES, metavar="F", help="automatic policy: free device bytes F")
    cap.add_argument("--headroom-bytes", type=BYTES, metavar="R", help="automatic policy: headroom R (default 0)")
    cap.add_argument(
        "--fixed-bytes", type=BYTES, default=0, metavar="X", help="fixed device bytes inside B(M) (default 0)"
    )
    spec = p.add_argument_group("speculative method")
    spec.add_argument("--speculative", type=SPECULATIVE, default="off", help="off (default), mtp, dflash, dflash2")
    spec.add_argument("--draft-window", type=POSITIVE_INT, metavar="K", help="MTP draft window K (default 1)")
    spec.add_argument("--mtp-layers", type=POSITIVE_INT, metavar="N", help="MTP layers (default 1)")
    spec.add_argument(
        "--draft-full-layers", type=NON_NEGATIVE_INT, metavar="N", help="DFlash full-attention layers (default 0)"
    )
    spec.add_argument("--draft-kv-heads", type=POSITIVE_INT, metavar="H",
                      help="Draft Full KV heads (default: the model's, --kv-heads)")
    spec.add_argument("--draft-head-dim", type=POSITIVE_INT, metavar="D",
                      help="Draft Full head dim (default: the model's, --head-dim)")
    mesh = p.add_argument_group("device mesh")
    mesh.add_argument(
        "--mesh", type=MESH, metavar="data=D,model=T",
        help="plan per device over a D x T mesh (KV heads over model, rows and pages over data); "
        "--max-concurrency and --kv-capacity are totals, --free-bytes and --fixed-bytes per device",
    )


_MODEL_FLAGS = ("layers", "kv_heads", "head_dim")
_RING_FLAGS = ("window_layers", "window", "ring_step_tokens")
_MTP_FLAGS = ("draft_window", "mtp_layers")
_DFLASH_FLAGS = ("draft_full_layers", "draft_kv_heads", "draft_head_dim")


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _speculative_from_args(args: argparse.Namespace):
    from ..schema.kinds import SpeculativeMethod
    from ..planning import SpeculativeConfig

    method = args.speculative
    allowed = {
        SpeculativeMethod.OFF: (),
        SpeculativeMethod.MTP: _MTP_FLAGS,
        SpeculativeMethod.DFLASH: _DFLASH_FLAGS,
        SpeculativeMethod.DFLASH2: _DFLASH_FLAGS,
    }[method]
    for attr in _MTP_FLAGS + _DFLASH_FLAGS:
        if getattr(args, attr) is not None and attr not in allowed:
            owner = "--speculative mtp" if attr in _MTP_FLAGS else "--speculative dflash or dflash2"
            raise ValueError(f"{_flag(attr)} applies only to {owner}; got --speculative {method.value}")
    return SpeculativeConfig(
        method=method,
        draft_window=args.draft_window if args.draft_window is not None else 1,
        mtp_layers=args.mtp_layers if args.mtp_layers is not None else 1,
        draft_full_layers=args.draft_full_layers or 0,
        draft_kv_heads=args.draft_kv_heads,
        draft_head_dim=args.draft_head_dim,
    )


def _dflash_note(speculative) -> str | None:
    if speculative.method.value in ("dflash", "dflash2") and not speculative.has_draft_full:
        return (
            f"--speculative {speculative.method.value} without --draft-full-layers plans no Draft Full pool "
            "(the draft model then keeps no paged KV here); pass --draft-full-layers N to plan one"
        )
    return None


class _Checkpoint:
    """What ``--model DIR`` contributes: the directory, its architecture and KV numbers."""

    def __init__(self, directory: str, info, config):
        self.directory = directory
        self.architecture = info.architecture
        self.family = info.family
        self.max_position_embeddings = info.max_position_embeddings
        kv = config.kv_config()
        self.layers = kv.num_layers
        self.kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rings = kv.rings

    def to_json(self) -> dict:
        return {
            "path": self.directory,
            "architecture": self.architecture,
            "family": self.family,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "window_layers": 0 if self.rings is None else self.rings.num_layers,
            "window": None if self.rings is None else self.rings.window,
        }

    def pairs(self, context_defaulted: bool) -> list[tuple[str, str]]:
        context = f"max_position_embeddings {_n(self.max_position_embeddings)}"
        if context_defaulted:
            context += " (the max context S)"
        return [
            ("checkpoint", f"{self.directory} ({self.architecture})"),
            ("model", (f"{_count(self.layers, 'full-attention layer')} + "
                       f"{_count(self.rings.num_layers, 'sliding-window layer')} (window {_n(self.rings.window)})"
                       if self.rings is not None else _count(self.layers, 'layer'))
                      + f", {_count(self.kv_heads, 'KV head')}, head dim {self.head_dim}; {context}"),
        ]


def _count(n: int, what: str) -> str:
    return f"{_n(n)} {what}" + ("" if n == 1 else "s")


def _check_model_flags(args: argparse.Namespace) -> None:
    """``--model`` excludes the model's numbers; without it they (and ``--max-context``) are required."""
    given = [_flag(a) for a in _MODEL_FLAGS if getattr(args, a) is not None]
    window = [_flag(a) for a in _RING_FLAGS[:2] if getattr(args, a) is not None]
    if args.model is not None and window:
        raise UsageError(f"{PROG} plan", f"argument {', '.join(window)}: not allowed with argument --model (the "
                                         f"model's sliding-window layers come from its config.json)")
    if len(window) == 1:
        missing = "--window" if window == ["--window-layers"] else "--window-layers"
        raise UsageError(f"{PROG} plan", f"{window[0]} needs {missing} too (sliding-window layers and their window)")
    if args.model is not None:
        if given:
            raise UsageError(f"{PROG} plan", f"argument {', '.join(given)}: not allowed with argument --model (the "
                                             f"model's layers, KV heads and head dim come from its config.json)")
        return
    missing = [_flag(a) for a in _MODEL_FLAGS + ("max_context",) if getattr(args, a) is None]
    if missing:
        hint = " (or --model DIR, which reads the model's numbers from its config.json)" if len(given) < 3 else ""
        raise UsageError(f"{PROG} plan", f"the following arguments are required: {', '.join(missing)}{hint}")


def _read_checkpoint(args: argparse.Namespace) -> _Checkpoint:
    """``--model DIR``'s ``config.json``, bounded and validated; ``--max-context`` checked against it."""
    from ..models.hf import model_config_from_hf, read_config
    from ..planning.bounds import MAX_CONTEXT

    directory = args.model
    if not os.path.isdir(directory):
        if not os.path.exists(directory):
            raise ValueError(f"--model {directory}: no such directory")
        raise ValueError(f"--model {directory}: not a directory (a Hugging Face checkpoint directory with config.json)")
    if not os.path.lexists(os.path.join(directory, "config.json")):
        raise ValueError(f"--model {directory}: no config.json in the directory (a Hugging Face checkpoint directory "
                         f"holds one)")
    context = None if args.max_context is None else min(args.max_context, MAX_CONTEXT)
    config, info = model_config_from_hf(read_config(directory), max_context=context)
    if args.max_context is not None and args.max_context > info.max_position_embeddings:
        raise ValueError(f"--max-context {args.max_context} exceeds the model's context: max_position_embeddings="
                         f"{info.max_position_embeddings} in {os.path.join(directory, 'config.json')} (allowed: at "
                         f"most {info.max_position_embeddings})")
    return _Checkpoint(directory, info, config)


_MODEL_PARAMETERS = {"num_layers": "num_hidden_layers", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
_MODEL_PARAMETER_RE = re.compile(r"\b(" + "|".join(_MODEL_PARAMETERS) + r")\b")


def _checkpoint_error(exc: ValueError, args: argparse.Namespace, *, reading: bool) -> UsageError:
    """A refusal while reading or planning ``--model DIR``, as one line.  The directory and the model's
    numbers keep their config.json names (they are no flags here) and the message names ``--model DIR``
    when it is about the checkpoint; the other parameters speak in flags."""
    held: list[str] = []

    def hold(text: str) -> str:
        held.append(text)
        return f"\x00{len(held) - 1}\x00"

    message = str(exc)
    path = re.compile(r"(?<![^\s'(=])" + re.escape(args.model) + r"(?=[/:\s')]|$)") if args.model else None
    about_model = reading or _MODEL_PARAMETER_RE.search(message) is not None
    if about_model and "--model" not in message and (path is None or not path.search(message)):
        message = f"--model {args.model}: {message}"
    if path is not None:
        message = path.sub(lambda m: hold(m.group(0)), message)
    message = _MODEL_PARAMETER_RE.sub(lambda m: hold(_MODEL_PARAMETERS[m.group(1)]), message)
    message = speak_in_flags(message, args._parser, _typed_flags(args))
    message = re.sub("\x00([0-9]+)\x00", lambda m: held[int(m.group(1))], message)
    return UsageError(f"{PROG} plan", message)


def _typed_flags(args: argparse.Namespace) -> list[str]:
    """The flags whose value is not their default: the ones the user typed, as far as ``args`` tells."""
    typed = []
    for action in args._parser._actions:
        if not action.option_strings or action.dest in ("help", "json"):
            continue
        value = getattr(args, action.dest, None)
        if value is not None and value != action.default:
            typed.append(action.option_strings[0])
    return typed


def run(args: argparse.Namespace) -> CommandOutput:
    """Plan the pools for the parsed flags (over a mesh with ``--mesh``); text view and ``--json`` object."""
    _check_model_flags(args)
    if args.model is None:
        return _run(args, None)
    try:
        checkpoint = _read_checkpoint(args)
    except ValueError as exc:
        raise _checkpoint_error(exc, args, reading=True) from None
    try:
        return _run(args, checkpoint)
    except ValueError as exc:
        raise _checkpoint_error(exc, args, reading=False) from None


def _run(args: argparse.Namespace, checkpoint: _Checkpoint | None) -> CommandOutput:
    from ..planning import AutomaticCapacity, ExplicitCapacity, ModelKVConfig, plan_kv_cache

    head: list[tuple[str, str]] = []
    if checkpoint is not None:
        head = checkpoint.pairs(context_defaulted=args.max_context is None)
        args = argparse.Namespace(**vars(args))
        args.layers, args.kv_heads, args.head_dim = checkpoint.layers, checkpoint.kv_heads, checkpoint.head_dim
        if checkpoint.rings is not None:
            args.window_layers, args.window = checkpoint.rings.num_layers, checkpoint.rings.window
        if args.max_context is None:
            args.max_context = checkpoint.max_position_embeddings
    speculative = _speculative_from_args(args)
    if args.kv_capacity is not None:
        if args.headroom_bytes is not None:
            raise ValueError("--headroom-bytes applies only to the automatic policy (--free-bytes)")
        policy = ExplicitCapacity(args.kv_capacity)
        policy_json = {"kind": "explicit", "kv_capacity": args.kv_capacity}
    else:
        policy = AutomaticCapacity(free_bytes=args.free_bytes, headroom_bytes=args.headroom_bytes or 0)
        policy_json = {"kind": "automatic", "free_bytes": policy.free_bytes, "headroom_bytes": policy.headroom_bytes}
    rings = None
    if args.window_layers is not None:
        from ..planning import DEFAULT_RING_STEP_TOKENS, WindowRings

        step = args.ring_step_tokens if args.ring_step_tokens is not None else DEFAULT_RING_STEP_TOKENS
        rings = WindowRings(args.window_layers, args.window, step)
    elif args.ring_step_tokens is not None:
        raise ValueError("--ring-step-tokens applies only to a model with sliding-window layers (--window-layers "
                         "and --window, or a --model whose layers slide)")
    model = ModelKVConfig(args.layers, args.kv_heads, args.head_dim, args.profile, rings=rings)
    if args.mesh is not None:
        out = _run_mesh_plan(args, model, policy, policy_json, speculative, head)
        if checkpoint is not None:
            out.data["model"] = checkpoint.to_json()
        return out
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
    if speculative.method.value == "mtp":
        data["draft_window"] = speculative.draft_window
    note = _dflash_note(speculative)
    data["notes"] = [note] if note else []
    if checkpoint is not None:
        data["model"] = checkpoint.to_json()
    return CommandOutput(data=data, text=_plan_text(plan, speculative, policy_json, head))


def _run_mesh_plan(args, model, policy, policy_json: dict, speculative, head=()) -> CommandOutput:
    from ..planning import plan_kv_cache_mesh

    mp = plan_kv_cache_mesh(model, args.mesh, max_context=args.max_context, max_concurrency=args.max_concurrency,
                            policy=policy, speculative=speculative, fixed_bytes=args.fixed_bytes)
    data = mp.to_json() | {"policy": policy_json}
    dev = mp.device
    per_device = _plan_text(dev, dev.pool_set.speculative, _local_policy_json(policy_json, mp))
    spec = mp.mesh
    lines = ["KV plan over a device mesh"]
    heads = mp.device.pools[next(iter(mp.device.pools))].layout.num_kv_heads
    rep = mp.head_replication
    head_text = f"{model.num_kv_heads} / {spec.model} = {heads} per device" if rep == 1 else (
        f"{model.num_kv_heads} < {spec.model}: each head stored {rep} times, {heads} per device "
        f"(the planes cost {rep}x the unreplicated cache)")
    single = mp.single_device_bytes
    lines += kv_lines([
        *head,
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


def _plan_text(plan, speculative, policy_json: dict, head=()) -> str:
    from ..schema.geometry import PAGE_SIZE as P
    from ..schema.kinds import PoolKind

    b = plan.pool_set
    method = speculative.method.value
    if method == "mtp":
        lead = b.physical_pages(PoolKind.MTP, plan.m) - plan.m
        method += (
            f" (draft window K = {speculative.draft_window}, {speculative.mtp_layers} MTP layer(s); "
            f"MTP pages = M + C*ceil((K-1)/P) = M + {_n(lead)})"
        )
    elif speculative.has_draft_full:
        method += f" ({speculative.draft_full_layers} draft full-attention layer(s))"
    elif method in ("dflash", "dflash2"):
        method += " (no draft full-attention layers: no Draft Full pool planned)"
    where = "M_min" if plan.m == b.m_min else ("M_max" if plan.m == b.m_max else "between M_min and M_max")
    lines = ["KV plan"]
    lines += kv_lines(
        [
            *head,
            ("page size P", f"{P} tokens"),
            ("max context S", f"{_n(b.max_context)} tokens (L = ceil(S/P) = {_n(b.logical_pages)} logical pages)"),
            ("max concurrency C", _n(b.max_concurrency)),
            ("speculative", method),
            ("Main range", f"M_min = max(L, C) = {_n(b.m_min)}  ..  M_max = C*L = {_n(b.m_max)} pages"),
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
    if plan.rings is not None:
        r = plan.rings
        lines += ["", "window rings (sliding-window layers: a fixed ring per row, outside the pools)"]
        lines += kv_lines([
            ("layers", f"{r.spec.num_layers}, window W = {_n(r.spec.window)} tokens, step T = {_n(r.spec.step_tokens)}"),
            ("pages per row", f"k = ceil((W + T - 2) / P) + 1 = {r.pages_per_row} ({_n(r.spec.ring_tokens)} tokens)"),
            ("bytes", f"{describe_bytes(r.bytes)} = C x {describe_bytes(r.row_bytes)} per row (part of B_min)"),
        ])
    curve = plan.curve
    lines += ["", "capacity curve  B(M) = B_min + (M - M_min) * B_step"]
    pairs = [
        ("B_min", f"{describe_bytes(curve.b_min)} at M_min = {_n(curve.m_min)}"),
        ("B_step", f"{describe_bytes(curve.b_step)} per Main page"),
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
