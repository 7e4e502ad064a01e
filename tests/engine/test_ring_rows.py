"""``kv_capacity="auto"`` with window rings sizes the rows: a row's rings are paid busy or not, so
every row holds a ``max_model_len`` sequence, at most ``max_num_seqs`` rows (ninfer_kv.engine.capacity)."""

import pytest

from ninfer_kv.engine.capacity import engine_plan
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, WindowRings, plan_kv_cache

KV = ModelKVConfig(1, 1, 64, rings=WindowRings(5, 128, 64))
S = 4096


def _bytes(rows: int) -> int:
    plan = plan_kv_cache(KV, max_context=S, max_concurrency=rows, policy=ExplicitCapacity(rows * S))
    return plan.device_bytes


@pytest.mark.parametrize("rows", [1, 3, 10])
def test_auto_gives_the_most_rows_that_each_hold_a_full_context_sequence(rows):
    free = _bytes(rows) + _bytes(rows + 1) - _bytes(rows) - 1  # one byte short of another row
    plan = engine_plan(KV, max_model_len=S, max_num_seqs=64, free_bytes=free)
    assert plan.max_concurrency == rows and plan.m == plan.pool_set.m_max
    assert plan.device_bytes <= free


def test_auto_keeps_max_num_seqs_when_memory_allows_and_explicit_capacity_always_does():
    plan = engine_plan(KV, max_model_len=S, max_num_seqs=8, free_bytes=_bytes(8) * 2)
    assert plan.max_concurrency == 8 and plan.m == plan.pool_set.m_max
    plan = engine_plan(KV, max_model_len=S, max_num_seqs=8, kv_capacity=S)
    assert plan.max_concurrency == 8 and plan.capacity_tokens == S


def test_memory_short_of_one_full_context_row_is_refused_by_name():
    with pytest.raises(ValueError, match="free_bytes"):
        engine_plan(KV, max_model_len=S, max_num_seqs=4, free_bytes=_bytes(1) - 1)
