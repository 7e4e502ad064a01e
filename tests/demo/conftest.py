"""Shared demo runs: small workloads on the tiny model, each run once per test session."""

from __future__ import annotations

import functools

import pytest

from ninfer_kv.demo import DemoConfig, WorkloadSpec, run_demo
from ninfer_kv.planning import ExplicitCapacity

WORKLOAD = WorkloadSpec(
    requests=12,
    max_new_tokens=12,
    system_prompt_tokens=150,
    system_prompts=2,
    burst=2,
    suffix_tokens=(4, 40),
    unique_prompt_tokens=(20, 120),
    seed=3,
)
"""12 requests, 9 sharing two 150-token system prompts in bursts of 2, budgets 6..12."""

ENGINE = dict(model="tiny", max_context=256, max_concurrency=4, capacity=ExplicitCapacity(10 * 64))
"""S = 256, C = 4 (buckets 1, 4), M = 10 Main pages: too few for 4 lanes and 2 retained prefixes."""


def demo_config(**overrides) -> DemoConfig:
    kw = dict(ENGINE, workload=WORKLOAD)
    kw.update(overrides)
    return DemoConfig(**kw)


@functools.lru_cache(maxsize=None)
def _run(key: tuple):
    return run_demo(demo_config(**dict(key)), progress=False)


def run(**overrides):
    """The result of a demo run with ``overrides`` (memoized for the session)."""
    return _run(tuple(sorted(overrides.items(), key=lambda kv: kv[0])))


@pytest.fixture(scope="session")
def bf16_run():
    return run()


def engine_steps(config: DemoConfig):
    """The jitted steps the engine of a one-device demo run ``config`` uses (shared per configuration)."""
    from ninfer_kv.models.decoder import StepConfig
    from ninfer_kv.schema.buckets import bucket_ladder, resolve_max_num_batched_tokens, token_ladder
    from ninfer_kv.models.decoder.steps import shared_steps

    budget = resolve_max_num_batched_tokens(None, config.max_concurrency)
    return shared_steps(StepConfig(model=config.model_config, profile=config.profile, impl=config.impl,
                                   batch_buckets=bucket_ladder(config.max_concurrency, 2),
                                   token_buckets=token_ladder(budget),
                                   draft_window=config.draft_window if config.speculative == "mtp" else 1))
