"""Build and run one serving demo: plan, parameters, the public engine (:mod:`.serve`), dense check, summary.

The parts live in their own modules: the configuration (:mod:`.config`), checkpoint directories
(:mod:`.checkpoint_cache`), the demo models' parameters and MTP drafter (:mod:`.drafter`), meshes
(:mod:`.mesh`), the dense check (:mod:`.dense_check`) and the statistics of the result
(:mod:`.summary`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax

from .. import ops
from ..schema.geometry import PAGE_SIZE, ceil_div
from ..planning import ModelKVConfig, plan_kv_cache, plan_kv_cache_mesh
from .checkpoint_cache import checkpoint_params
from .config import DemoConfig
from .dense_check import check_dense
from .drafter import demo_params
from .progress import CompileClock, make_progress
from .requests import check_workload_fits, make_workload
from .serve import serve
from .summary import DemoResult, demo_result

__all__ = ["run_demo", "validate"]



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
    lead = config.draft_window - 1 if config.speculative == "mtp" else 0
    check_workload_fits(requests, config.max_context, ceil_div(config.max_context, PAGE_SIZE), lead)
    kv = ModelKVConfig(model.num_layers, model.num_kv_heads, model.head_dim, config.profile)
    common = dict(max_context=config.max_context, max_concurrency=config.max_concurrency, policy=config.capacity,
                  speculative=config.speculative_config, fixed_bytes=config.fixed_bytes)
    plan = plan_kv_cache(kv, **common) if config.mesh is None else plan_kv_cache_mesh(kv, config.mesh, **common)
    _resolved_impl(config.impl)
    return plan, requests


def run_demo(config: DemoConfig = DemoConfig(), *, progress: bool = True) -> DemoResult:
    """Serve ``config.workload`` with continuous batching through a KV store; see :class:`DemoResult`."""
    plan, requests = validate(config)
    model = config.model_config
    if config.checkpoint is not None:
        params, calibration = checkpoint_params(config.checkpoint, config.max_context), None
    else:
        params, calibration = demo_params(model, config.seed)
    impl = _resolved_impl(config.impl)
    bar = make_progress(len(requests), enabled=progress)
    generated = 0
    clock = {"compile": CompileClock.read(), "start": time.perf_counter()}

    def begin():
        clock["compile"], clock["start"] = CompileClock.read(), time.perf_counter()

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
    compile_seconds = CompileClock.read() - clock["compile"]
    dense = check_dense(params, model, config.profile, served.records) if config.dense_check else None
    return demo_result(config, plan, served, generated=generated, serve_seconds=serve_seconds,
                       compile_seconds=compile_seconds, dense=dense, calibration=calibration, impl=impl,
                       device=jax.devices()[0].platform)
