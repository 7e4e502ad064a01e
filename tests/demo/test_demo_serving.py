"""End-to-end serving runs of the demo (the public engine) at small size: correctness against the
dense model, compilation per bucket, leaks, prefix forks, memory pressure, MTP settlement and lease
growth."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.demo import DemoConfig, run_demo

from .conftest import WORKLOAD, demo_config, engine_steps, run


def _budgets():
    from ninfer_kv.demo import make_workload

    return {r.id: r.max_new_tokens for r in make_workload(WORKLOAD, 256)}


def _common_checks(result):
    d = result.to_json()
    assert d["requests"] == WORKLOAD.requests
    assert d["leaked_pages"] == 0
    assert d["leaked_host_extents"] == 0
    assert sum(d["finish_reasons"].values()) == WORKLOAD.requests
    assert set(d["finish_reasons"]) == {"length"}
    for name, n in d["compiles"].items():  # at most once per batch bucket it ran in
        assert n <= len(d["buckets"].get(name, [])), (name, n, d["buckets"])
    assert d["generated_tokens"] == sum(r.generated.size for r in result.records)
    return d


def test_bf16_matches_dense_and_leaks_nothing(bf16_run):
    d = _common_checks(bf16_run)
    assert d["dense_match"] is True
    assert d["dense"]["tokens_match"] is True
    assert d["dense"]["max_relative_diff"] <= d["dense"]["tolerance"] == 1e-3
    assert d["dense"]["checked_tokens"] == d["generated_tokens"]
    budgets = _budgets()
    for r in bf16_run.records:  # no lease growth: every request spends exactly its budget
        assert r.generated.size == budgets[r.request.id]
        assert not r.bounded


def test_prefix_forks_and_memory_pressure(bf16_run):
    d = bf16_run.to_json()
    assert d["prefix_hits"] >= 1
    # every hit reuses at least the 150-token system prompt, at any token (not rounded to a page)
    hits = [r for r in bf16_run.records if r.prefix_hit]
    assert len(hits) == d["prefix_hits"] and all(150 <= r.cached_tokens < r.request.prompt_tokens for r in hits)
    assert d["prefix_tokens_reused"] == sum(r.cached_tokens for r in hits)
    assert d["prefix_jobs"] >= 2  # each system prompt computed once for the requests waiting on it
    ev = d["evictions"]
    assert ev["offloads"] + ev["releases"] >= 1  # 10 pages cannot hold 4 lanes and both prefixes
    assert d["peak_pages"]["main"] == d["pool_pages"]["main"] == 10
    assert d["admission_waits"] >= 1
    assert d["peak_active"] <= 4


def test_every_step_compiles_once_per_bucket_across_runs(bf16_run):
    again = run_demo(demo_config(), progress=False)  # a second run on the same jitted steps
    assert all(n == 0 for n in again["compiles"].values()), again["compiles"]
    steps = engine_steps(demo_config())
    for name, step in steps.steps.items():
        per_signature = step.counter.compiles_by_signature()
        assert all(n == 1 for n in per_signature.values()), (name, per_signature)
        shapes = len(steps.config.batch_buckets) * (len(steps.config.token_buckets) if "ragged" in name else 1)
        assert step.compiles <= shapes * 2  # each bucket (rows x tokens when ragged), with or without sampling
        assert step.compiles == step.traces


# -m slow: a whole second demo run (its own compiles).  By default quantized caches are served in
# tests/server and tests/models/test_generate_cli.py (int8) and checked against transformers in
# tests/models/test_hf_oracle.py (nvfp4), the dense reference with the K8V4 round trip runs in
# tests/examples/test_model_paged_steps.py, and the demo's code paths in the bf16 runs here.
@pytest.mark.slow
def test_k8v4_completes_and_matches_its_codec():
    d = _common_checks(run(profile="k8v4"))
    assert d["profile"] == "k8v4"
    assert d["dense_match"] is True  # the dense reference applies the same K8V4 round trip


def test_mtp_accepts_and_rejects_drafts_and_matches_dense():
    result = run(speculative="mtp", draft_window=3)
    d = _common_checks(result)
    m = d["mtp"]
    assert 0 < m["drafts_accepted"] < m["drafts_verified"]  # both settlement paths ran
    assert m["tokens_per_round"] > 1.0
    assert d["dense_match"] is True
    assert set(d["pool_pages"]) == {"main", "mtp"}
    assert d["buckets"]["verify"] and d["buckets"]["mtp_draft"] and d["buckets"]["mtp_extend"]
    assert d["units"].get("decode", 0) == 0  # every token came from verify rounds
    budgets = _budgets()
    assert all(r.generated.size == budgets[r.request.id] for r in result.records)


# -m slow: a longer workload (budgets of 64 tokens) on its own pool size.  By default the lease-growth
# run of the shared workload below grants lease pages and ends a request bounded (checked against the
# dense model), and tests/engine/test_engine_core.py ends one at its covered frontier.
@pytest.mark.slow
def test_kv_lease_growth_bounded_completion():
    # budgets up to 64 tokens, an 8-token lease window and 8 Main pages: lanes must grow their
    # leases at round boundaries, and some cannot (bounded completion, finish reason "length")
    from ninfer_kv.demo import WorkloadSpec
    from ninfer_kv.planning import ExplicitCapacity

    workload = WorkloadSpec(requests=12, max_new_tokens=64, system_prompts=2, burst=2, suffix_tokens=(4, 40),
                            unique_prompt_tokens=(20, 120), seed=3)
    result = run_demo(
        demo_config(workload=workload, kv_lease_growth=True, lease_window_tokens=8, capacity=ExplicitCapacity(8 * 64)),
        progress=False,
    )
    d = result.to_json()
    assert d["kv_lease_growth"] is True
    assert d["leaked_pages"] == 0
    assert d["finish_reasons"] == {"length": 12}
    assert d["lease_pages_granted"] >= 1
    assert d["bounded_completions"] >= 1
    bounded = [r for r in result.records if r.bounded]
    assert len(bounded) == d["bounded_completions"]
    assert all(r.generated.size < r.request.max_new_tokens for r in bounded)
    assert d["dense_match"] is True  # what was generated before the bound is still exact


def test_kv_lease_growth_generates_prefixes_of_the_full_generation(bf16_run):
    result = run(kv_lease_growth=True)
    d = _common_checks(result)
    assert d["dense_match"] is True
    full = {r.request.id: r.generated.tolist() for r in bf16_run.records}
    for r in result.records:  # scheduling never changes tokens; a bound only cuts them short
        got = r.generated.tolist()
        assert got == full[r.request.id][: len(got)]
        assert r.bounded or len(got) == len(full[r.request.id])


def test_offload_and_restore_under_pressure(bf16_run):
    d = bf16_run.to_json()
    assert d["host_tier"] is True
    assert d["evictions"]["offloads"] >= 1
    assert d["offloaded_pages"] >= 1
    assert d["restored_pages"] >= 1
    assert d["leaked_host_extents"] == 0
    assert d["dense_match"] is True


def test_without_host_arena_pressure_releases_checkpoints():
    d = run(host_bytes=0).to_json()
    assert d["host_tier"] is False
    assert d["offloaded_pages"] == d["restored_pages"] == 0
    assert d["evictions"]["releases"] >= 1
    assert d["dense_match"] is True and d["leaked_pages"] == 0


# -m slow: a run on a larger pool (its own compiles).  By default the lease-growth run above serves the
# shared workload under another schedule and must produce prefixes of the same tokens.
@pytest.mark.slow
def test_same_tokens_under_other_schedules(bf16_run):
    # more pages change admission, batching and evictions, never the greedy tokens
    from ninfer_kv.planning import ExplicitCapacity

    other = run(capacity=ExplicitCapacity(16 * 64))  # M = M_max: no pressure at all
    assert other["dense_match"] is True
    for a, b in zip(bf16_run.records, other.records):
        assert a.request.id == b.request.id
        np.testing.assert_array_equal(a.generated, b.generated)
    assert other["tokens_digest"] == bf16_run["tokens_digest"]


def test_tokens_digest_is_sha256_of_the_tokens_in_request_order(bf16_run):
    import hashlib
    import json

    doc = [[r.request.id, r.generated.tolist()] for r in bf16_run.records]
    assert [r for r, _ in doc] == sorted(r for r, _ in doc)
    want = hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()
    assert bf16_run["tokens_digest"] == want and bf16_run["mesh"] is None
    doc[0][1][0] ^= 1  # one token differs: another digest
    assert hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest() != want


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="speculative"):
        DemoConfig(speculative="dflash")
    with pytest.raises(ValueError, match="model"):
        DemoConfig(model="huge")
    with pytest.raises(ValueError, match="impl"):
        DemoConfig(impl="cuda")
    with pytest.raises(ValueError, match="host_bytes"):
        DemoConfig(host_bytes=-1)
    with pytest.raises(ValueError, match="runs on one device only"):
        DemoConfig(speculative="mtp", mesh="data=2")
    with pytest.raises(ValueError, match="max_concurrency=8 does not split"):
        DemoConfig(mesh="data=3")
    with pytest.raises(ValueError, match="2 KV heads; they do not fit the model axis of size 3"):
        DemoConfig(mesh="model=3")


def test_host_arena_too_small_releases_instead():
    # 100 KiB cannot hold a 150-token prefix of the tiny model (3 pages of 64 KiB):
    # those offloads are refused by the arena and the victim is released; serving is unaffected
    d = run(host_bytes=100 * 1024).to_json()
    ev = d["evictions"]
    assert ev["host_full"] >= 1 and ev["releases"] >= ev["host_full"]
    assert d["peak_host_bytes"] <= 100 * 1024 and d["leaked_host_extents"] == 0
    assert d["dense_match"] is True and d["leaked_pages"] == 0
