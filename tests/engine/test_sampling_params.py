"""SamplingParams: vLLM's defaults, normalization, every bound refused by name, the device config."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ninfer_kv.engine import sampling_params as sp
from ninfer_kv.engine.sampling_params import SamplingParams
from ninfer_kv.models.decoder.sampling import SamplingConfig


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs, p.n) == ((), (), False, None, 1)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_normalization():
    p = SamplingParams(max_tokens=None, temperature=np.float32(0.5), top_k=-1, stop="###", stop_token_ids=[np.int64(7), 2], seed=np.uint32(5))
    assert p.max_tokens is None and p.top_k == 0 and p.stop == ("###",) and p.stop_token_ids == (7, 2)
    assert type(p.temperature) is float and p.temperature == 0.5
    assert type(p.seed) is int and type(p.stop_token_ids[0]) is int
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(top_p=1).top_p == 1.0 and type(SamplingParams(top_p=1).top_p) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n = 2
    assert hash(p) == hash(SamplingParams(**dataclasses.asdict(p)))


def test_bounds_are_accepted_at_their_edges():
    SamplingParams(max_tokens=1)
    SamplingParams(max_tokens=sp.MAX_TOKENS_LIMIT)
    SamplingParams(temperature=sp.MAX_TEMPERATURE, top_p=1e-9, top_k=sp.MAX_TOP_K)
    SamplingParams(seed=0)
    SamplingParams(seed=sp.SEED_LIMIT - 1)
    SamplingParams(stop=["x" * sp.MAX_STOP_STRING_CHARS] * sp.MAX_STOP_STRINGS)
    SamplingParams(stop_token_ids=list(range(sp.MAX_STOP_TOKEN_IDS)))
    SamplingParams(logprobs=0)
    SamplingParams(logprobs=sp.MAX_LOGPROBS, n=sp.MAX_N)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("max_tokens", 0, "[1, 2147483584]"),
        ("max_tokens", sp.MAX_TOKENS_LIMIT + 1, "[1, 2147483584]"),
        ("max_tokens", -5, "max_tokens=-5"),
        ("temperature", -0.1, "[0, 100]"),
        ("temperature", 100.5, "[0, 100]"),
        ("temperature", math.nan, "not finite"),
        ("temperature", math.inf, "not finite"),
        ("temperature", 10**400, "temperature="),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", math.nan, "not finite"),
        ("top_k", -2, "[-1, 2147483647]"),
        ("top_k", 2**31, "[-1, 2147483647]"),
        ("seed", -1, "[0, 4294967295]"),
        ("seed", 2**32, "[0, 4294967295]"),
        ("stop", [""], "1 to 1024 characters"),
        ("stop", ["x" * 1025], "1 to 1024 characters"),
        ("stop", ["x"] * 17, "at most 16"),
        ("stop_token_ids", [-1], "stop_token_ids[0]=-1"),
        ("stop_token_ids", [0] * 1025, "at most 1024"),
        ("logprobs", -1, "[0, 20]"),
        ("logprobs", 21, "[0, 20]"),
        ("n", 0, "[1, 128]"),
        ("n", 129, "[1, 128]"),
    ],
)
def test_out_of_range_values_are_refused_by_name(field, value, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 16.0),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("temperature", True),
        ("temperature", "0.5"),
        ("temperature", None),
        ("top_p", np.bool_(True)),
        ("top_k", 2.0),
        ("top_k", False),
        ("seed", 1.5),
        ("seed", True),
        ("stop", 5),
        ("stop", {"a"}),
        ("stop", ["a", 3]),
        ("stop_token_ids", 5),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("ignore_eos", 1),
        ("ignore_eos", None),
        ("logprobs", 1.0),
        ("n", 2.0),
        ("n", None),
    ],
)
def test_wrong_kinds_are_type_errors(field, value):
    with pytest.raises(TypeError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)


def test_sampling_config():
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9)
    assert p.sampling_config(11) == SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, seed=11)
    seeded = SamplingParams(temperature=0.7, seed=2**32 - 1, n=3)
    assert seeded.sampling_config(11).seed == 2**32 - 1  # the request's seed wins
    assert [seeded.sampling_config(11, index=i).seed for i in range(3)] == [2**32 - 1, 0, 1]
    assert SamplingParams(temperature=0).sampling_config(0).greedy
    with pytest.raises(ValueError, match=r"index=3"):
        seeded.sampling_config(0, index=3)
    with pytest.raises(ValueError, match=r"seed=-1"):
        p.sampling_config(-1)
    with pytest.raises(TypeError, match=r"seed=None"):
        p.sampling_config(None)
