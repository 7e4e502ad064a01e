"""``ninfer-kv demo`` without ``--kv-capacity``: the default capacity follows ``--max-concurrency``
and ``--max-context`` into the plan's allowed range; an explicit bad value is still refused."""

from __future__ import annotations

import json

import pytest

from ninfer_kv.cli import build_parser, main
from ninfer_kv.demo.cli import DEFAULT_KV_CAPACITY, DEFAULT_PAGES_PER_ROW, config_from_args
from ninfer_kv.schema.geometry import PAGE_SIZE
from ninfer_kv.planning import (
    ExplicitCapacity,
    KVPoolSetLayout,
    ModelKVConfig,
    plan_kv_cache,
    plan_kv_cache_mesh,
)

SMALLEST = ["--model", "tiny", "--requests", "1", "--max-new-tokens", "1", "--system-prompts", "0", "--no-progress"]
"""The smallest workload the demo takes: one request on the tiny model, one new token."""


def _config(argv):
    return config_from_args(build_parser().parse_args(["demo", *argv]))


def _kv(config) -> ModelKVConfig:
    m = config.model_config
    return ModelKVConfig(m.num_layers, m.num_kv_heads, m.head_dim, config.profile)


def _allowed(config) -> tuple[int, int, int, int]:
    """``(lo, hi, M_min, M_max)`` of --kv-capacity for ``config`` per the planning code (totals over
    the data shards with a mesh)."""
    d = config.mesh.data if config.mesh is not None else 1
    b = KVPoolSetLayout(_kv(config), config.max_context, config.max_concurrency // d, config.speculative_config)
    lo = max(config.max_context, (b.m_min - 1) * d * PAGE_SIZE + 1)
    return lo, b.max_m() * d * PAGE_SIZE, b.m_min, b.max_m()


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--max-concurrency", "1"],
        ["--max-concurrency", "2"],
        ["--max-concurrency", "3"],
        ["--max-concurrency", "64"],
        ["--max-concurrency", "5000"],
        ["--max-context", "64"],
        ["--max-context", "1"],
        ["--max-context", "65536"],
        ["--max-context", "65536", "--max-concurrency", "1"],
        ["--max-context", "64", "--max-concurrency", "1"],
        ["--max-context", "4096", "--max-concurrency", "200"],
        ["--speculative", "mtp", "--max-concurrency", "1"],
        ["--model", "tiny", "--profile", "k8v4", "--max-concurrency", "1"],
        ["--mesh", "data=2,model=1", "--max-concurrency", "2"],
        ["--mesh", "data=2,model=2", "--max-concurrency", "64", "--max-context", "128"],
    ],
    ids=lambda a: " ".join(a) or "defaults",
)
def test_default_capacity_is_in_the_plans_range(argv):
    config = _config(argv)
    assert isinstance(config.capacity, ExplicitCapacity)
    k = config.capacity.kv_capacity
    lo, hi, m_min, m_max = _allowed(config)
    assert lo <= k <= hi, (k, lo, hi)
    # the planning code accepts it, at the page count the default promises
    common = dict(max_context=config.max_context, max_concurrency=config.max_concurrency, policy=config.capacity,
                  speculative=config.speculative_config)
    if config.mesh is None:
        pages, d = plan_kv_cache(_kv(config), **common).m, 1
    else:
        pages, d = plan_kv_cache_mesh(_kv(config), config.mesh, **common).m_local, config.mesh.data
    rows = config.max_concurrency // d
    assert pages == min(max(DEFAULT_PAGES_PER_ROW * rows, m_min), m_max)
    assert k == pages * d * PAGE_SIZE


def test_defaults_keep_the_documented_capacity(capsys):
    """At the default S and C the capacity is the one ``--help`` names (fewer pages than the lanes want)."""
    assert _config([]).capacity.kv_capacity == DEFAULT_KV_CAPACITY == DEFAULT_PAGES_PER_ROW * 8 * PAGE_SIZE
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"{DEFAULT_PAGES_PER_ROW} pages of 64 tokens per row of --max-concurrency" in text
    assert f"{DEFAULT_KV_CAPACITY} tokens at the defaults" in text


@pytest.mark.parametrize("extra", [["--kv-capacity", "4096"], ["--free-bytes", "1GiB"]])
def test_an_explicit_policy_is_kept(extra):
    config = _config(["--max-concurrency", "1", *extra])
    if extra[0] == "--kv-capacity":
        assert config.capacity == ExplicitCapacity(4096)
    else:
        assert config.capacity.free_bytes == 1 << 30


@pytest.mark.parametrize("argv", [["--max-concurrency", "1"], ["--max-concurrency", "64"], ["--max-context", "4096"]])
def test_an_explicit_bad_capacity_is_one_line_naming_flag_value_and_range(argv, capsys):
    lo, hi, _, _ = _allowed(_config(argv))
    bad = hi + PAGE_SIZE
    assert main(["demo", *argv, *SMALLEST, "--kv-capacity", str(bad)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("ninfer-kv demo: error:")
    assert f"--kv-capacity {bad} is out of range" in lines[0] and f"[{lo}, {hi}]" in lines[0]
    assert "the default" not in lines[0].split(" is out of range")[0]  # the value typed, not a default


def test_max_concurrency_1_runs_with_the_default_capacity(capsys):
    assert main(["demo", "--max-concurrency", "1", *SMALLEST, "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out.strip().splitlines()[-1])
    config = _config(["--max-concurrency", "1", *SMALLEST])
    _, _, m_min, _ = _allowed(config)
    assert data["requests"] == 1 and data["generated_tokens"] == 1 and data["dense_match"] is True
    assert data["pool_pages"] == {"main": m_min} and data["leaked_pages"] == 0
