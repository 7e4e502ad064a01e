"""Speculative decoding in the engine (an MTP head): every request produces exactly the tokens of
plain decoding — greedy and sampled, forked from cached prefixes at any token, ``n > 1``, stop
tokens — both settlement paths run, and nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.demo.config import MODELS
from ninfer_kv.demo.drafter import demo_params as _params
from ninfer_kv.engine import DecoderModel, EngineCore, SamplingParams
from ninfer_kv.models.decoder import ModelConfig
from ninfer_kv.planning import ExplicitCapacity, SpeculativeConfig, plan_kv_cache
from ninfer_kv.store import EntitlementPolicy, KVStore

from .engine_fixtures import assert_store_empty, drain

K = 3
MAX_LEN = 256
SEQS = 4


def _engine(draft_window: int, *, capacity: int = SEQS * 4 * 64, lease_growth: bool = False,
            host_bytes: int | None = None) -> EngineCore:
    config = ModelConfig(**MODELS["tiny"], mtp=True)
    params, _ = _params(config, 0)  # the MTP head fitted as a drafter (drafts are often right)
    speculative = SpeculativeConfig("mtp", draft_window=K) if draft_window else None
    plan = plan_kv_cache(config.kv_config("bf16"), max_context=MAX_LEN, max_concurrency=SEQS,
                         policy=ExplicitCapacity(capacity), speculative=speculative)
    policy = EntitlementPolicy(kv_lease_growth=lease_growth, window_tokens=16, cushion_tokens=K + 1)
    store = KVStore(plan, entitlement=policy, host_bytes=host_bytes)
    return EngineCore(DecoderModel(params, config, impl="ffi", draft_window=draft_window), store, seed=7)


def _serve(engine: EngineCore, prompts, params) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    outs = drain(engine)
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}


def _workload(seed: int = 0):
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(1, 256, 100)]
    prompts, params = [], []
    for i in range(8):
        own = [int(t) for t in rng.integers(1, 256, int(rng.integers(3, 40)))]
        prompt = (system if i % 3 else []) + own
        prompts.append(prompt)
        if i % 4 == 1:
            params.append(SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=i))
        elif i == 6:
            params.append(SamplingParams(max_tokens=9, temperature=0.0, n=2))
        else:
            params.append(SamplingParams(max_tokens=int(rng.integers(4, 12)), temperature=0.0))
    return prompts, params


def test_speculative_rounds_produce_the_tokens_of_plain_decoding():
    prompts, params = _workload()
    plain = _serve(_engine(0), prompts, params)
    engine = _engine(K)
    spec = _serve(engine, prompts, params)
    assert spec == plain
    st = engine.stats
    assert st.spec_rounds > 0 and 0 < st.drafts_accepted < st.drafts_verified  # accept and reject paths
    assert st.decode_tokens > st.spec_rounds  # more than one token per round on average
    assert engine.cache.stats.hits >= 1  # forks from cached prefixes resumed their MTP state
    assert_store_empty(engine)


def test_a_second_turn_forks_a_finished_sequence_at_any_token():
    engine = _engine(K)
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(1, 256, 70)]
    out = _serve(engine, [first], [SamplingParams(max_tokens=11, temperature=0.0)])["r0"][0]
    engine_plain = _engine(0)
    _serve(engine_plain, [first], [SamplingParams(max_tokens=11, temperature=0.0)])
    # turn 2 extends turn 1 up to a token inside its last page, then diverges
    second = first + out[:5] + [int(t) for t in rng.integers(1, 256, 9)]
    engine.add_request("t2", second, SamplingParams(max_tokens=12, temperature=0.0))
    engine_plain.add_request("t2", second, SamplingParams(max_tokens=12, temperature=0.0))
    a = drain(engine)["t2"]
    b = drain(engine_plain)["t2"]
    assert a.num_cached_tokens == b.num_cached_tokens == len(first) + 5
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_stop_token_inside_an_accepted_run_ends_there():
    prompts, params = _workload(1)
    plain = _serve(_engine(0), prompts[:3], [SamplingParams(max_tokens=12, temperature=0.0)] * 3)
    stop = plain["r1"][0][4]  # a token the second request generates at its fifth step
    sp = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])] * 3
    spec = _serve(_engine(K), prompts[:3], sp)
    for rid, comps in spec.items():
        full = plain[rid][0]
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert comps[0] == full[:cut], rid


# -m slow: its own pool size (every step compiles again) and 60-token budgets.  By default lease growth and
# bounded completions run in tests/engine/test_engine_core.py and tests/demo, speculative rounds cut short of
# K + 1 tokens (by a budget) in the tests above, and an MTP store growing leases in
# tests/store/test_state_machine.py (TestGrowth).
@pytest.mark.slow
def test_lease_growth_with_speculation_ends_bounded_requests_at_length():
    prompts, params = _workload(2)
    engine = _engine(K, capacity=6 * 64, lease_growth=True)
    sp = [SamplingParams(max_tokens=60, temperature=0.0) for _ in prompts]
    got = _serve(engine, prompts, sp)
    full = _serve(_engine(0), prompts, sp)
    for rid, comps in got.items():
        assert comps[0] == full[rid][0][: len(comps[0])]
    assert engine.stats.bounded_completions >= 1 and engine.stats.lease_pages_granted >= 1
    assert_store_empty(engine)


def test_mismatched_model_and_store_are_refused():
    config = ModelConfig(**MODELS["tiny"], mtp=True)
    params, _ = _params(config, 0)
    plan = plan_kv_cache(config.kv_config("bf16"), max_context=MAX_LEN, max_concurrency=SEQS,
                         policy=ExplicitCapacity(SEQS * 4 * 64))
    with pytest.raises(ValueError, match="no MTP pool"):
        EngineCore(DecoderModel(params, config, impl="ffi", draft_window=K), KVStore(plan))
    with pytest.raises(ValueError, match="needs a model with an MTP head"):
        DecoderModel(params, ModelConfig(**MODELS["tiny"]), draft_window=K)
