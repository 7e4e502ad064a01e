"""Workload generation: determinism, shared prefixes, bursts and bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.demo import WorkloadSpec, make_workload


@st.composite
def specs(draw):
    lo = draw(st.integers(1, 30))
    ulo = draw(st.integers(1, 50))
    return WorkloadSpec(
        requests=draw(st.integers(1, 40)),
        max_new_tokens=draw(st.integers(1, 40)),
        system_prompt_tokens=draw(st.integers(1, 200)),
        system_prompts=draw(st.integers(0, 4)),
        shared_fraction=draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])),
        suffix_tokens=(lo, lo + draw(st.integers(0, 30))),
        unique_prompt_tokens=(ulo, ulo + draw(st.integers(0, 60))),
        burst=draw(st.integers(1, 5)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None)
@given(specs(), st.integers(2, 600))
def test_workload_invariants(spec, vocab):
    reqs = make_workload(spec, vocab)
    assert [r.id for r in reqs] == list(range(spec.requests))
    shared = [r for r in reqs if r.prefix_group is not None]
    expected_shared = int(round(spec.shared_fraction * spec.requests)) if spec.system_prompts else 0
    assert len(shared) == expected_shared
    systems = {}
    for r in reqs:
        assert r.prompt.dtype == np.int32 and not r.prompt.flags.writeable
        assert r.prompt.min() >= 1 and r.prompt.max() < vocab
        assert -(-spec.max_new_tokens // 2) <= r.max_new_tokens <= spec.max_new_tokens
        assert r.total_tokens <= spec.longest_sequence
        if r.prefix_group is None:
            assert r.prefix_tokens == 0
            assert spec.unique_prompt_tokens[0] <= r.prompt_tokens <= spec.unique_prompt_tokens[1]
        else:
            assert r.prefix_tokens == spec.system_prompt_tokens < r.prompt_tokens
            suffix = r.prompt_tokens - r.prefix_tokens
            assert spec.suffix_tokens[0] <= suffix <= spec.suffix_tokens[1]
            head = r.prompt[: r.prefix_tokens].tobytes()
            assert systems.setdefault(r.prefix_group, head) == head  # one system prompt per group
    # shared requests cycle through the system prompts in bursts
    groups = [r.prefix_group for r in shared]
    assert groups == [(k // spec.burst) % spec.system_prompts for k in range(len(shared))]


def test_deterministic_and_seed_sensitive():
    a = make_workload(WorkloadSpec(seed=5), 512)
    b = make_workload(WorkloadSpec(seed=5), 512)
    c = make_workload(WorkloadSpec(seed=6), 512)
    assert all(np.array_equal(x.prompt, y.prompt) and x.max_new_tokens == y.max_new_tokens for x, y in zip(a, b))
    assert any(not np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c))


def test_default_workload_shape():
    reqs = make_workload(WorkloadSpec(), 512)
    assert len(reqs) == 32
    shared = [r for r in reqs if r.prefix_group is not None]
    assert len(shared) == 24 and {r.prefix_group for r in shared} == {0, 1, 2}
    assert all(r.prefix_tokens == 150 and r.prefix_tokens % 64 != 0 for r in shared)


@pytest.mark.parametrize(
    "kw",
    [
        dict(requests=0),
        dict(max_new_tokens=0),
        dict(shared_fraction=1.5),
        dict(suffix_tokens=(0, 4)),
        dict(suffix_tokens=(5, 4)),
        dict(unique_prompt_tokens=(3,)),
        dict(burst=0),
        dict(seed=-1),
    ],
)
def test_spec_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        WorkloadSpec(**kw)
