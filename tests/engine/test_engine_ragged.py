"""Ragged rounds: decodes ride beside prompt tokens in one ragged unit, within the round's budget.

Every request still produces exactly the tokens it produces served alone; a round never feeds more
than ``max_num_batched_tokens`` tokens; a decoding sequence gets its token every round while a long
prompt is prefilled beside it; an engine whose model has no ragged call (or a speculative one) keeps
its rectangular rounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.engine import SamplingParams

from .engine_fixtures import MAX_NUM_SEQS, VOCAB, check_engine, drain, make_llm, reference


def _tokens(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, n)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_decodes_ride_beside_a_long_prompt_and_every_round_keeps_the_budget():
    rng = np.random.default_rng(31)
    engine = make_llm(max_num_batched_tokens=48).engine
    assert engine.ragged_rounds
    short, long_ = _tokens(rng, 20), _tokens(rng, 150)
    engine.add_request("a", short, _greedy(8))
    engine.step()  # "a": its whole prompt and first token in one ragged round
    a = engine.requests["a"]
    assert len(a.sequences[0].generated) == 1
    engine.add_request("b", long_, _greedy(4))
    rounds = 0
    b = engine.requests["b"]
    while not (b.sequences and b.sequences[0].generated):
        before = len(a.sequences[0].generated)
        engine.step()
        check_engine(engine)
        rounds += 1
        assert len(a.sequences[0].generated) == before + 1, "the decoding sequence must get its token every round"
    # 150 prompt tokens beside one decode in rounds of 48 tokens: 47 prompt tokens per round
    assert rounds == -(-150 // 47)
    log = engine.runner.log
    assert log.units["ragged"] >= rounds + 1
    assert max(tokens for _, tokens in log.buckets["ragged"]) <= 48  # (rows, tokens) shapes
    done = drain(engine)
    for rid, prompt, n in (("a", short, 8), ("b", long_, 4)):
        assert done[rid].outputs[0].token_ids == reference().greedy(prompt, n), rid


def test_several_prompts_fill_a_round_in_arrival_order():
    rng = np.random.default_rng(32)
    engine = make_llm(max_num_batched_tokens=100).engine
    prompts = {f"r{i}": _tokens(rng, n) for i, n in enumerate((40, 50, 30, 60))}
    for rid, p in prompts.items():
        engine.add_request(rid, p, _greedy(3))
    engine.step()
    firsts = {rid: len(engine.requests[rid].sequences[0].generated) for rid in prompts}
    # 40 + 50 fit the first round (r0, r1 produce), r2 gets the last 10 tokens, r3 none yet
    assert firsts == {"r0": 1, "r1": 1, "r2": 0, "r3": 0}
    assert engine.requests["r2"].sequences[0].frontier == 10
    done = drain(engine)
    for rid, p in prompts.items():
        assert done[rid].outputs[0].token_ids == reference().greedy(p, 3), rid


def test_a_budget_below_the_rows_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_llm(max_num_batched_tokens=MAX_NUM_SEQS - 1)
