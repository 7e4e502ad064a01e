"""Build and run one serving demo: model, plan, the public engine (:mod:`.serve`), dense check, summary."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
import warnings

import jax

from .. import ops
from ..geometry import PAGE_SIZE, ceil_div
from ..planning import (
    AutomaticCapacity,
    ExplicitCapacity,
    ModelKVConfig,
    SpeculativeConfig,
    plan_kv_cache,
    plan_kv_cache_mesh,
)
from ..mesh_spec import MeshSpec
from ..profiles import KVProfile
from ..models.decoder import IMPLS, ModelConfig, init_params
from .dense_check import check_dense
from .drafter import fit_mtp_head
from .progress import make_progress
from .requests import WorkloadSpec, check_workload_fits, make_workload
from .serve import serve
from .summary import DemoResult

__all__ = ["DemoConfig", "MODELS", "BACKENDS", "run_demo", "validate", "tokens_digest"]

MODELS = {
    "tiny": dict(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=256),
    "small": dict(vocab_size=512, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128, mlp_dim=512),
}
"""Demo model sizes (float32 Qwen-style decoders with random weights).  ``DemoConfig.model`` may also be a
Hugging Face checkpoint directory (:mod:`ninfer_kv.models.hf`), served in float32 so the dense check's
tolerances apply, stopping at its EOS ids."""


def _stamp(directory: str) -> tuple:
    """The names, sizes and modification times of a directory's files (a changed checkpoint is re-read)."""
    entries = sorted(os.scandir(directory), key=lambda e: e.name)
    return tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())


def _checkpoint_config(directory: str, max_context: int) -> tuple[ModelConfig, tuple[int, ...]]:
    """The float32 model configuration and the stop tokens of a checkpoint directory (no weights read)."""
    return _checkpoint_config_at(directory, max_context, _stamp(directory))


@functools.lru_cache(maxsize=8)
def _checkpoint_config_at(directory: str, max_context: int, stamp: tuple) -> tuple[ModelConfig, tuple[int, ...]]:
    from ..models.hf import eos_token_ids, model_config_from_hf, read_config

    model, info = model_config_from_hf(read_config(directory), dtype="float32", max_context=max_context)
    return model, eos_token_ids(directory, info.eos_token_ids, vocab_size=model.vocab_size)


def _checkpoint_params(directory: str, max_context: int) -> dict:
    return _checkpoint_params_at(directory, max_context, _stamp(directory))


@functools.lru_cache(maxsize=2)
def _checkpoint_params_at(directory: str, max_context: int, stamp: tuple) -> dict:
    from ..models.hf import load_checkpoint

    return load_checkpoint(directory, dtype="float32", max_context=max_context).params

BACKENDS = ("off", "mtp")

DEFAULT_KV_CAPACITY = 24 * 64
DEFAULT_HOST_BYTES = 16 * 2**20


def _int_at_least(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= {minimum}")
    return value


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on.

    Attributes:
      workload: the requests to serve.
      model: a key of :data:`MODELS`, or a Hugging Face checkpoint directory (``backend="off"``).
      profile: the KV profile of the Main (and MTP) pool.
      backend: ``"off"`` or ``"mtp"`` (speculative decoding with the model's MTP head).
      draft_window: MTP draft window K (``backend="mtp"`` only).
      impl: op implementation (``auto``: Pallas on GPU, FFI on CPU).
      kv_lease_growth: lease a bounded window instead of the whole output budget.
      lease_window_tokens: the growth window (with ``kv_lease_growth``).
      lease_cushion_tokens: the per-lane cushion beyond the window: the tokens one decode round
        writes (1, or ``draft_window + 1`` with MTP), so the step about to launch is always covered.
      host_bytes: Host arena bytes for offloaded checkpoints (0: no Host tier).
      max_context, max_concurrency: S and C of the plan.
      capacity: the plan's capacity policy (explicit tokens or free bytes).
      fixed_bytes: the fixed part of ``B(M)``.
      seed: weights seed (the workload has its own seed).
      dense_check: recompute every request densely after the run.
      mesh: serve over a ``data x model`` device mesh (main model only, through
        :class:`~ninfer_kv.engine.data_parallel.DataParallelEngine`), or ``None`` for one device.  ``max_concurrency`` and ``kv_capacity`` are totals over
        the data shards, ``host_bytes`` is per data shard.
    """

    workload: WorkloadSpec = WorkloadSpec()
    model: str = "small"
    profile: KVProfile = KVProfile.BF16
    backend: str = "off"
    draft_window: int = 3
    impl: str = "auto"
    kv_lease_growth: bool = False
    lease_window_tokens: int = 4096
    host_bytes: int = DEFAULT_HOST_BYTES
    max_context: int = 512
    max_concurrency: int = 8
    capacity: ExplicitCapacity | AutomaticCapacity = ExplicitCapacity(DEFAULT_KV_CAPACITY)
    fixed_bytes: int = 0
    seed: int = 0
    dense_check: bool = True
    mesh: MeshSpec | None = None

    def __post_init__(self):
        if not isinstance(self.workload, WorkloadSpec):
            raise TypeError(f"workload must be a WorkloadSpec, got {type(self.workload).__name__}")
        if self.model not in MODELS and not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r} is neither a demo model ({', '.join(MODELS)}) nor a checkpoint "
                             f"directory")
        if self.checkpoint is not None and self.backend != "off":
            raise ValueError(f"backend={self.backend!r} needs the demo model's MTP head; a checkpoint directory "
                             f"({self.model}) is served with backend 'off'")
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not supported by the demo; allowed: {', '.join(BACKENDS)}")
        _int_at_least("draft_window", self.draft_window, 1)
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not supported; allowed: {', '.join(IMPLS)}")
        _int_at_least("lease_window_tokens", self.lease_window_tokens, 1)
        _int_at_least("host_bytes", self.host_bytes, 0)
        _int_at_least("max_context", self.max_context, 1)
        _int_at_least("max_concurrency", self.max_concurrency, 1)
        _int_at_least("fixed_bytes", self.fixed_bytes, 0)
        _int_at_least("seed", self.seed, 0)
        if not isinstance(self.capacity, (ExplicitCapacity, AutomaticCapacity)):
            raise TypeError(f"capacity must be ExplicitCapacity or AutomaticCapacity, got {type(self.capacity).__name__}")
        self.model_config.kv_config(self.profile)  # head dim vs profile: a clear ValueError early
        if self.mesh is not None:
            object.__setattr__(self, "mesh", MeshSpec.parse(self.mesh))
            if self.backend != "off":
                raise ValueError(f"backend={self.backend!r} runs on one device only; with mesh={self.mesh} "
                                 "the backend must be 'off'")
            self.mesh.local_concurrency(self.max_concurrency)
            h, t = self.model_config.num_kv_heads, self.mesh.model
            if h % t and t % h:
                raise ValueError(
                    f"model {self.model!r} has {h} KV heads; they do not fit the model axis of size {t}: it must "
                    f"divide {h} or be a multiple of it"
                )
            if self.model_config.num_heads % self.mesh.model:
                raise ValueError(
                    f"the model's {self.model_config.num_heads} query heads do not split over the model axis of "
                    f"size {self.mesh.model}"
                )

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint directory when ``model`` names one, else ``None``."""
        return None if self.model in MODELS else self.model

    @property
    def model_config(self) -> ModelConfig:
        """The model served (a demo size, or the checkpoint's configuration in float32)."""
        if self.checkpoint is not None:
            return _checkpoint_config(self.checkpoint, self.max_context)[0]
        return ModelConfig(**MODELS[self.model], mtp=self.backend == "mtp")

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Token ids that end a request: the checkpoint's EOS ids (none for the demo sizes)."""
        return () if self.checkpoint is None else _checkpoint_config(self.checkpoint, self.max_context)[1]

    @property
    def lease_cushion_tokens(self) -> int:
        return self.draft_window + 1 if self.backend == "mtp" else 1

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig("mtp", draft_window=self.draft_window) if self.backend == "mtp" else None


@functools.lru_cache(maxsize=4)
def _params(model: ModelConfig, seed: int) -> tuple[dict, float | None]:
    """Model parameters from ``seed``; with an MTP head, the head fitted as a drafter (and its agreement)."""
    params = init_params(model, seed)
    if not model.mtp:
        return params, None
    head = fit_mtp_head(params, model, seed)
    return head.params, head.agreement


class _CompileClock:
    """Seconds of XLA backend compilation, summed from ``jax.monitoring`` events (process-wide)."""

    seconds = 0.0
    _registered = False

    @classmethod
    def read(cls) -> float:
        if not cls._registered:
            from jax import monitoring

            monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._registered = True
        return cls.seconds

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.seconds += float(duration)


def _resolved_impl(impl: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ops.resolve_impl(impl).name


def validate(config: DemoConfig):
    """Resolve the plan and the workload of ``config``; ``ValueError`` if they cannot be served.

    Returns ``(plan, requests)``.  Cheap: no parameters, no compilation.
    """
    model = config.model_config
    requests = make_workload(config.workload, model.vocab_size)
    if config.stop_tokens:
        requests = [dataclasses.replace(r, stop_tokens=config.stop_tokens) for r in requests]
    lead = config.draft_window - 1 if config.backend == "mtp" else 0
    check_workload_fits(requests, config.max_context, ceil_div(config.max_context, PAGE_SIZE), lead)
    kv = ModelKVConfig(model.num_layers, model.num_kv_heads, model.head_dim, config.profile)
    common = dict(max_context=config.max_context, max_concurrency=config.max_concurrency, policy=config.capacity,
                  speculative=config.speculative, fixed_bytes=config.fixed_bytes)
    plan = plan_kv_cache(kv, **common) if config.mesh is None else plan_kv_cache_mesh(kv, config.mesh, **common)
    _resolved_impl(config.impl)
    return plan, requests


def tokens_digest(records) -> str:
    """sha256 hex of every request's generated tokens in request order: the UTF-8 bytes of the
    compact JSON list ``[[request id, [token, ...]], ...]``."""
    doc = [[int(r.request.id), [int(t) for t in r.generated]] for r in sorted(records, key=lambda r: r.request.id)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def run_demo(config: DemoConfig = DemoConfig(), *, progress: bool = True) -> DemoResult:
    """Serve ``config.workload`` with continuous batching through a KV store; see :class:`DemoResult`."""
    plan, requests = validate(config)
    model = config.model_config
    if config.checkpoint is not None:
        params, calibration = _checkpoint_params(config.checkpoint, config.max_context), None
    else:
        params, calibration = _params(model, config.seed)
    impl = _resolved_impl(config.impl)
    bar = make_progress(len(requests), enabled=progress)
    generated = 0
    clock = {"compile": _CompileClock.read(), "start": time.perf_counter()}

    def begin():
        clock["compile"], clock["start"] = _CompileClock.read(), time.perf_counter()

    def on_finish(record):
        nonlocal generated
        generated += int(record.generated.size)
        elapsed = time.perf_counter() - clock["start"]
        bar.update(1, tokens=generated, tok_s=f"{generated / max(elapsed, 1e-9):.0f}")

    try:
        served = serve(config, plan, requests, params, dense_check=config.dense_check, on_finish=on_finish, begin=begin)
    finally:
        bar.close()
    serve_seconds = time.perf_counter() - clock["start"]
    compile_seconds = _CompileClock.read() - clock["compile"]
    records = served.records

    dense = None
    if config.dense_check:
        dense = check_dense(params, model, config.profile, records)
    compiles = served.compiles
    st = served.stats
    finish_reasons: dict[str, int] = {}
    for r in records:
        finish_reasons[r.finish_reason] = finish_reasons.get(r.finish_reason, 0) + 1
    data = {
        "requests": len(records),
        "generated_tokens": generated,
        "tokens_per_s": generated / serve_seconds if serve_seconds > 0 else 0.0,
        "serve_seconds": serve_seconds,
        "compile_seconds": compile_seconds,
        "tokens_per_s_excl_compile": generated / (serve_seconds - compile_seconds)
        if serve_seconds > compile_seconds
        else 0.0,
        "dense_match": bool(dense.match) if dense is not None else None,
        "dense_tolerance": dense.tolerance if dense is not None else None,
        "dense": dense.to_json() if dense is not None else None,
        "prefix_hits": served.cache["hits"],
        "prefix_tokens_reused": served.cache["hit_tokens"],
        "prefix_jobs": st.prefix_jobs,
        "offloaded_pages": served.offloaded_pages,
        "restored_pages": served.restored_pages,
        "evictions": {"offloads": served.cache["offloaded"], "releases": served.cache["released"],
                      "host_full": served.cache["host_full"]},
        "host_tier": served.host_tier,
        "peak_host_bytes": served.peak_host_bytes,
        "compiles": compiles,
        "buckets": served.buckets,
        "units": served.units,
        "peak_pages": served.peak_pages,
        "pool_pages": served.pool_pages,
        "leaked_pages": served.leaked_pages,
        "leaked_host_extents": served.leaked_extents,
        "finish_reasons": finish_reasons,
        "bounded_completions": st.bounded_completions,
        "lease_pages_granted": st.lease_pages_granted,
        "peak_active": served.peak_active,
        "admission_waits": st.admission_waits,
        "rounds": st.rounds,
        "prefill_tokens": st.prefill_tokens,
        "mtp": None,
        "profile": config.profile.value,
        "impl": impl,
        "backend": config.backend,
        "kv_lease_growth": config.kv_lease_growth,
        "device": jax.devices()[0].platform,
        "mesh": None if config.mesh is None else {"data": config.mesh.data, "model": config.mesh.model},
        "mesh_steps": served.mesh_steps,
        "tokens_digest": tokens_digest(records),
        "model": {
            "name": config.model,
            "layers": model.num_layers,
            "kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
            "d_model": model.d_model,
            "vocab_size": model.vocab_size,
        },
        "plan": plan.to_json(),
        "seed": config.seed,
        "workload_seed": config.workload.seed,
    }
    if config.backend == "mtp":
        data["mtp"] = {
            "draft_window": config.draft_window,
            "head_calibration_agreement": calibration,
            "rounds": st.spec_rounds,
            "drafts_verified": st.drafts_verified,
            "drafts_accepted": st.drafts_accepted,
            "acceptance_rate": st.drafts_accepted / st.drafts_verified if st.drafts_verified else 0.0,
            "tokens_per_round": st.decode_tokens / st.spec_rounds if st.spec_rounds else 0.0,
        }
    return DemoResult(data, tuple(sorted(records, key=lambda r: r.request.id)))
