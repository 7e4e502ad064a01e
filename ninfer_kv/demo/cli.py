"""The ``ninfer-kv demo`` subcommand: serve a workload end to end through the KV store.

Examples::

    ninfer-kv demo                                  # 32 requests, small model, BF16, memory pressure
    ninfer-kv demo --speculative mtp --draft-window 3   # MTP speculative decoding
    ninfer-kv demo --profile k8v4 --kv-lease-growth --json
    ninfer-kv demo --mesh data=2,model=4 --impl ffi --json   # 8 devices (forced host devices on a CPU)

This module only declares arguments; everything heavy is imported when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..cli.types import IMPL, IMPL_HELP
from ..cli import BYTES, POSITIVE_INT, PROFILE, CommandOutput, bounded_int, register_subcommand
from ..cli.app import EXIT_CHECK_FAILED
from ..schema.profiles import KVProfile

__all__ = ["configure", "run"]

_SPECULATIVE = ("off", "mtp")
_MODELS = ("tiny", "small")

DEFAULT_REQUESTS = 32
DEFAULT_MAX_NEW_TOKENS = 24
DEFAULT_MAX_CONTEXT = 512
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_PAGES_PER_ROW = 3
"""Default Main capacity: 3 pages of 64 tokens per row of ``--max-concurrency``, within the plan's
range (24 pages at the defaults: fewer than 8 lanes plus 3 prefixes want, so offloads happen)."""
DEFAULT_KV_CAPACITY = DEFAULT_PAGES_PER_ROW * DEFAULT_MAX_CONCURRENCY * 64  # tokens at the default S and C
DEFAULT_HOST_BYTES = "16MiB"
DEFAULT_DRAFT_WINDOW = 3
DEFAULT_LEASE_WINDOW = 4096


def _choice(name: str, allowed: tuple[str, ...]):
    """An argparse ``type=`` accepting one of ``allowed`` (case-insensitive) with a one-line error."""

    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not supported; allowed: {', '.join(allowed)}")
        return value

    parse.__name__ = name
    return parse


def configure(p: argparse.ArgumentParser) -> None:
    """Declare the demo's arguments (the capacity flags are those of ``ninfer-kv plan``)."""
    work = p.add_argument_group("workload")
    work.add_argument("--requests", type=bounded_int(1, 1 << 14), default=DEFAULT_REQUESTS, metavar="N",
                      help=f"requests to serve (default {DEFAULT_REQUESTS})")
    work.add_argument("--max-new-tokens", type=POSITIVE_INT, default=DEFAULT_MAX_NEW_TOKENS, metavar="T",
                      help=f"largest output budget; each request draws from [T/2, T] (default {DEFAULT_MAX_NEW_TOKENS})")
    work.add_argument("--system-prompt-tokens", type=bounded_int(1, 1 << 16), default=150, metavar="T",
                      help="length of each shared system prompt (default 150)")
    work.add_argument("--system-prompts", type=bounded_int(0, 256), default=3, metavar="N",
                      help="distinct system prompts shared by 3/4 of the requests (default 3; 0: all unique)")
    work.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="seed of the weights and the workload (default 0)")
    model = p.add_argument_group("model and kernels")
    model.add_argument("--model", type=_model, default="small", metavar="tiny|small|DIR",
                       help="tiny (2 layers, head dim 64), small (4 layers, head dim 128; default) or a Hugging Face "
                            "checkpoint directory (Qwen3, Qwen2, Llama, Mistral; served in float32, stops at its EOS)")
    model.add_argument("--profile", "--kv-cache-dtype", dest="profile", type=PROFILE, default="bf16",
                       help=f"KV profile: {', '.join(p.value for p in KVProfile)} (default bf16; short names too)")
    model.add_argument("--impl", type=IMPL, default="auto", help=IMPL_HELP)
    model.add_argument("--mesh", type=_mesh, default=None, metavar="data=D,model=T",
                       help="serve over a D x T device mesh: each request on a data shard (chosen by the scheduler), "
                            "the KV heads split over the model axis, planes never gathered; on a CPU D*T host devices "
                            "are forced before JAX starts; --max-concurrency and --kv-capacity are totals over the "
                            "data shards, --host-bytes per data shard; --speculative off only (default: one device)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", type=_choice("speculative", _SPECULATIVE), default="off", help="off (default) or mtp")
    spec.add_argument("--draft-window", type=POSITIVE_INT, metavar="K",
                      help=f"MTP draft window K (default {DEFAULT_DRAFT_WINDOW}; --speculative mtp only)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-context", type=bounded_int(1, 1 << 16), default=DEFAULT_MAX_CONTEXT, metavar="S",
                     help=f"per-sequence ceiling S (default {DEFAULT_MAX_CONTEXT})")
    eng.add_argument("--max-concurrency", type=POSITIVE_INT, default=DEFAULT_MAX_CONCURRENCY, metavar="C",
                     help=f"active rows C (default {DEFAULT_MAX_CONCURRENCY})")
    eng.add_argument("--kv-lease-growth", action="store_true",
                     help="lease a bounded window per request, grown at decode-round boundaries")
    eng.add_argument("--kv-lease-window", type=POSITIVE_INT, metavar="TOKENS",
                     help=f"growth window with --kv-lease-growth (default {DEFAULT_LEASE_WINDOW})")
    eng.add_argument("--host-bytes", type=BYTES, default=None, metavar="B",
                     help=f"Host arena for offloaded checkpoints (default {DEFAULT_HOST_BYTES}; 0 disables offload)")
    cap = p.add_argument_group(
        "capacity policy",
        "At most one of --kv-capacity and --free-bytes.  Default: --kv-capacity of "
        f"{DEFAULT_PAGES_PER_ROW} pages of 64 tokens per row of --max-concurrency, raised or lowered into the "
        "range that --max-context and --max-concurrency allow (small enough to force offloads; "
        f"{DEFAULT_KV_CAPACITY} tokens at the defaults).",
    )
    policy = cap.add_mutually_exclusive_group()
    policy.add_argument("--kv-capacity", type=POSITIVE_INT, metavar="TOKENS",
                        help="explicit Main capacity in tokens (a total over the data shards with --mesh)")
    policy.add_argument("--free-bytes", type=BYTES, metavar="F", help="automatic policy: free device bytes F")
    cap.add_argument("--headroom-bytes", type=BYTES, metavar="R", help="automatic policy: headroom R (default 0)")
    cap.add_argument("--fixed-bytes", type=BYTES, default=0, metavar="X", help="fixed device bytes inside B(M) (default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--no-dense-check", action="store_true", help="skip the dense recomputation after the run")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _model(text: str) -> str:
    """``--model``: a demo size (case-insensitive) or an existing checkpoint directory."""
    value = str(text).strip()
    if value.lower() in _MODELS:
        return value.lower()
    if os.path.isdir(value):
        return value
    raise argparse.ArgumentTypeError(f"model {text!r} is neither {' nor '.join(_MODELS)} nor a checkpoint directory")


def _mesh(text: str):
    from ..schema.mesh_spec import MeshSpec

    try:
        return MeshSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_FORCE_DEVICES = "--xla_force_host_platform_device_count"


def ensure_devices(count: int) -> None:
    """Make ``count`` devices available for a mesh: before JAX's platforms start, force ``count``
    host devices (``XLA_FLAGS``; no effect on a GPU); afterwards, ``ValueError`` unless the
    process already has ``count`` devices."""
    started = False
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    if not started:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FORCE_DEVICES)]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_FORCE_DEVICES}={count}"])
    import jax

    have = len(jax.devices())
    if have < count:
        raise ValueError(
            f"--mesh needs {count} devices, JAX started with {have}; on a CPU run it in a fresh process (or set "
            f"XLA_FLAGS={_FORCE_DEVICES}={count} before JAX starts)"
        )


def default_kv_capacity(config) -> int:
    """The ``--kv-capacity`` a run gets when the command line names no capacity policy.

    :data:`DEFAULT_PAGES_PER_ROW` Main pages per row, clamped to the plan's page range
    ``[M_min, M_max]`` for the config's ``--max-context`` and ``--max-concurrency`` (per data shard
    with ``--mesh``; the result is the total over the shards).  Where the plan itself refuses those
    flags, the fixed default is returned and planning reports the flag at fault.
    """
    from ..schema.geometry import PAGE_SIZE
    from ..planning import KVPoolSetLayout, ModelKVConfig

    model = config.model_config
    shards = config.mesh.data if config.mesh is not None else 1
    rows = config.max_concurrency // shards
    try:
        kv = ModelKVConfig(model.num_layers, model.num_kv_heads, model.head_dim, config.profile)
        pool_set = KVPoolSetLayout(kv, config.max_context, rows, config.speculative_config, config.fixed_bytes)
    except ValueError:
        return DEFAULT_KV_CAPACITY
    pages = pool_set.clamp_m(DEFAULT_PAGES_PER_ROW * rows)
    return pages * PAGE_SIZE * shards


def config_from_args(args: argparse.Namespace):
    """The :class:`~ninfer_kv.demo.config.DemoConfig` of parsed arguments (``ValueError`` on bad combinations)."""
    from ..device.memory import host_memory_bytes
    from ..schema.sizes import parse_bytes
    from ..planning import AutomaticCapacity, ExplicitCapacity
    from .config import DemoConfig
    from .requests import WorkloadSpec

    if args.draft_window is not None and args.speculative != "mtp":
        raise ValueError(f"--draft-window applies only to --speculative mtp; got --speculative {args.speculative}")
    if args.kv_lease_window is not None and not args.kv_lease_growth:
        raise ValueError("--kv-lease-window applies only with --kv-lease-growth")
    if args.free_bytes is not None:
        capacity = AutomaticCapacity(free_bytes=args.free_bytes, headroom_bytes=args.headroom_bytes or 0)
    else:
        if args.headroom_bytes is not None:
            raise ValueError("--headroom-bytes applies only to the automatic policy (--free-bytes)")
        capacity = ExplicitCapacity(args.kv_capacity if args.kv_capacity is not None else DEFAULT_KV_CAPACITY)
    memory = host_memory_bytes()
    if args.host_bytes is not None and memory is not None and args.host_bytes > memory:
        raise ValueError(
            f"--host-bytes {args.host_bytes} is out of range; it must be at most this machine's memory, "
            f"{memory} bytes (the Host arena is allocated when the demo starts)"
        )
    workload = WorkloadSpec(
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        system_prompt_tokens=args.system_prompt_tokens,
        system_prompts=args.system_prompts,
        seed=args.seed,
    )
    config = DemoConfig(
        workload=workload,
        model=args.model,
        profile=args.profile,
        speculative=args.speculative,
        draft_window=args.draft_window if args.draft_window is not None else DEFAULT_DRAFT_WINDOW,
        impl=args.impl,
        kv_lease_growth=args.kv_lease_growth,
        lease_window_tokens=args.kv_lease_window if args.kv_lease_window is not None else DEFAULT_LEASE_WINDOW,
        host_bytes=args.host_bytes if args.host_bytes is not None else parse_bytes(DEFAULT_HOST_BYTES),
        max_context=args.max_context,
        max_concurrency=args.max_concurrency,
        capacity=capacity,
        fixed_bytes=args.fixed_bytes,
        seed=args.seed,
        dense_check=not args.no_dense_check,
        mesh=args.mesh,
    )
    if args.free_bytes is None and args.kv_capacity is None:  # the default follows S and C
        config = dataclasses.replace(config, capacity=ExplicitCapacity(default_kv_capacity(config)))
    return config


def run(args: argparse.Namespace) -> CommandOutput:
    """Run the demo; the table is the text view, the result object the ``--json`` view."""
    from .run import run_demo, validate

    config = config_from_args(args)
    if config.mesh is not None:
        ensure_devices(config.mesh.size)
    validate(config)  # plan and workload errors surface as one-line usage errors, before any compile
    result = run_demo(config, progress=not args.no_progress)
    failed = result["dense_match"] is False
    return CommandOutput(data=result.to_json(), text=result.table(), exit_code=EXIT_CHECK_FAILED if failed else 0)


register_subcommand(
    "demo",
    help="serve a workload end to end through the KV store (continuous batching, prefix forks, offload, MTP)",
    configure=configure,
    run=run,
)
