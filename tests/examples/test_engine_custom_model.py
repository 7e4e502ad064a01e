"""``examples/engine_custom_model.py``: a model in plain JAX served by the engine, checked against a
dense (no cache) forward of the same model, with a cached prefix reused by a second request."""

from __future__ import annotations

import contextlib
import io

import pytest

from examples import engine_custom_model as example
from ninfer_kv.engine import EngineModel


@pytest.fixture(scope="module")
def served():
    """The example run once: its results and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = example.main()  # asserts the greedy tokens equal the dense recomputation
    return result, printed.getvalue()


def test_toy_model_is_an_engine_model():
    model = example.ToyModel(example.init_weights(seed=0))
    assert isinstance(model, EngineModel)
    assert model.kv_config("k8v4").head_dim == example.HEAD_DIM


def test_served_greedy_tokens_match_the_dense_model(served):
    result, out = served
    assert "dense check: OK" in out.splitlines()
    first, second = result["greedy"]
    assert len(first) == len(second) == 8
    assert len(set(first) | set(second)) > 2  # not a degenerate constant output


def test_second_request_reuses_the_shared_prefix(served):
    result, out = served
    assert result["cached_tokens"] == [0, result["shared_prefix"]] == [0, 100]
    assert "cached tokens 100: the shared prefix was not recomputed" in out
    # request 3 repeats request 2's prompt: everything but the last prompt token comes from the cache
    assert result["sampled_cached_tokens"] == 119


def test_sampling_goes_through_the_sampled_steps(served):
    result, _ = served
    a, b = result["sampled"]
    assert len(a) == len(b) == 8 and a != b  # n=2 completions, each with its own key
    assert all(0 <= t < example.VOCAB for t in a + b)
    traces = set(result["traces"])
    assert {("prefill", (1, 64), False), ("decode", (1, 1), False)} <= traces  # greedy: sampling=None
    assert any(sampled for _, _, sampled in traces)  # temperature > 0: SamplingRows
    assert len(result["traces"]) == len(traces)  # one compilation per shape and sampling kind
