"""``config.json`` of real models mapped onto the decoder: real sizes plan (and load, in the slow sweep);
hostile values (huge, negative, non-finite, mistyped) are one CheckpointError naming the key and range."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.models.decoder import param_count, param_shapes
from ninfer_kv.models.decoder.layers import scaled_inv_freq
from ninfer_kv.models.hf import CheckpointError, UnsupportedModelError, model_config_from_hf
from ninfer_kv.models.hf.published_configs import LLAMA_2_7B, LLAMA_3_2_1B, MISTRAL_7B_V0_3, QWEN2_5_0_5B, QWEN3_0_6B
from ninfer_kv.planning import ExplicitCapacity, plan_kv_cache

from np_forward import inv_freq

QWEN3_YARN = dict(QWEN3_0_6B, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                  max_position_embeddings=131072)


@pytest.mark.parametrize("cfg, layers, kv_heads, head_dim, tied, non_embedding", [
    (QWEN3_0_6B, 28, 8, 128, True, 0.44e9),
    (LLAMA_3_2_1B, 16, 8, 64, True, 0.97e9),
    (QWEN2_5_0_5B, 24, 2, 64, True, 0.36e9),
    (MISTRAL_7B_V0_3, 32, 8, 128, False, 6.98e9),
    (LLAMA_2_7B, 32, 32, 128, False, 6.48e9),
], ids=["qwen3-0.6b", "llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b-v0.3", "llama-2-7b"])
def test_real_configs_map_and_plan(cfg, layers, kv_heads, head_dim, tied, non_embedding):
    model, info = model_config_from_hf(cfg)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.tie_embeddings) == (layers, kv_heads, head_dim, tied)
    assert info.eos_token_ids == (cfg["eos_token_id"],)
    shapes = param_shapes(model)  # nothing allocated
    embedding = model.vocab_size * model.d_model * (1 if tied else 2)
    assert abs(param_count(shapes) - embedding - non_embedding) / non_embedding < 0.01  # the published sizes
    plan = plan_kv_cache(model.kv_config("k8v4"), max_context=2048, max_concurrency=8,
                         policy=ExplicitCapacity(8 * 2048))
    d = model.head_dim
    per_token_head = (d + 2) + (d // 2 + d // 16)  # K: FP8 row + scale; V: NVFP4 + scales
    assert model.main_layout("k8v4").page_bytes == 64 * layers * kv_heads * per_token_head
    assert plan.device_bytes >= plan.m * model.main_layout("k8v4").page_bytes


def test_qwen2_and_qwen3_options():
    q2, _ = model_config_from_hf(QWEN2_5_0_5B)
    assert (q2.qk_norm, q2.qkv_bias, q2.o_bias, q2.rope_scaling) == (False, True, False, None)
    q3, _ = model_config_from_hf(QWEN3_0_6B)
    assert (q3.qk_norm, q3.qkv_bias, q3.o_bias) == (True, False, False)
    q3b, _ = model_config_from_hf(dict(QWEN3_0_6B, attention_bias=True))
    assert (q3b.qkv_bias, q3b.o_bias) == (True, True)
    l3, _ = model_config_from_hf(LLAMA_3_2_1B)
    assert l3.rope_scaling.kind == "llama3" and l3.rope_scaling.factor == 32.0 and not l3.qk_norm


@pytest.mark.parametrize("cfg", [LLAMA_3_2_1B, QWEN3_YARN, dict(LLAMA_2_7B, rope_scaling={"type": "linear", "factor": 4.0})],
                         ids=["llama3", "yarn", "linear"])
def test_scaled_rope_frequencies_match_the_documented_formulas(cfg):
    model, _ = model_config_from_hf(cfg)
    got = scaled_inv_freq(model.head_dim, model.rope_theta, model.rope_scaling)
    want, scale = inv_freq(cfg, model.head_dim)  # float64, written from transformers' documentation
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert model.rope_scaling.cos_sin_scale == pytest.approx(scale)
    assert not np.allclose(got, scaled_inv_freq(model.head_dim, model.rope_theta, None))


def test_sliding_windows_are_checked_against_the_context():
    mistral_v01 = dict(MISTRAL_7B_V0_3, sliding_window=4096, rope_theta=10000.0)
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=4096.*max_context=32768"):
        model_config_from_hf(mistral_v01)
    model, info = model_config_from_hf(mistral_v01, max_context=4096)  # within the window: full attention
    assert info.max_context == 4096
    # Qwen2.5's sliding_window is inert while use_sliding_window is false
    model_config_from_hf(QWEN2_5_0_5B, max_context=32768)
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=32768.*layers 21\.\.23"):
        model_config_from_hf(dict(QWEN2_5_0_5B, use_sliding_window=True, max_window_layers=21), max_context=65536)


@pytest.mark.slow
def test_qwen3_0_6b_sized_checkpoint_loads(tmp_path):
    """A real size end to end: random weights of Qwen3-0.6B's shape written, loaded and run (1.2 GB)."""
    from ninfer_kv.models.generate import PagedGenerator
    from ninfer_kv.models.hf import load_checkpoint, save_random_checkpoint

    save_random_checkpoint(tmp_path, QWEN3_0_6B, seed=0)
    model = load_checkpoint(tmp_path)
    assert model.bytes_read == 2 * param_count(param_shapes(model.config))
    gen = PagedGenerator(model.params, model.config, max_context=128, max_batch=1)
    seq = gen.generate([[1, 2, 3, 4]], max_new_tokens=2)[0]
    assert len(seq.generated) == 2


# -- hostile values: one CheckpointError naming the key, the value and the allowed range ---------------




YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("change, match", [
    (dict(num_hidden_layers=10**9), r"num_hidden_layers=1000000000 is invalid; it must be an integer in \[1, 4096\]"),
    (dict(num_attention_heads=2**40), r"num_attention_heads=1099511627776 is invalid; it must be an integer in \[1, 4096\]"),
    (dict(num_key_value_heads=0), r"num_key_value_heads=0 is invalid; it must be an integer in \[1, 4096\]"),
    (dict(head_dim=2**20), r"head_dim=1048576 is invalid; it must be an integer in \[1, 4096\]"),
    (dict(hidden_size=2**31), r"hidden_size=2147483648 is invalid; it must be an integer in \[1, 65536\]"),
    (dict(intermediate_size=-3), r"intermediate_size=-3 is invalid; it must be an integer in \[1, 1048576\]"),
    (dict(vocab_size=2**64), r"vocab_size=18446744073709551616 is invalid; it must be an integer in \[1, 16777216\]"),
    (dict(vocab_size=151936.0), r"vocab_size=151936\.0 is invalid"),
    (dict(max_position_embeddings=2**31), r"max_position_embeddings=2147483648 is invalid; it must be an integer in "
                                          r"\[1, 2147483584\]"),
    (dict(rope_theta=float("inf")), r"rope_theta=inf is invalid; it must be a finite number in \(1, 1e\+12\]"),
    (dict(rope_theta=float("nan")), r"rope_theta=nan is invalid"),
    (dict(rope_theta="1e6"), r"rope_theta='1e6' is invalid"),
    (dict(rms_norm_eps=float("-inf")), r"rms_norm_eps=-inf is invalid; it must be a finite number in \(0\.0, 1\.0\)"),
    (dict(rope_scaling=dict(YARN, original_max_position_embeddings="32768")),
     r"rope_scaling\.original_max_position_embeddings='32768' is invalid; it must be an integer in \[1, 2147483584\]"),
    (dict(rope_scaling=dict(YARN, factor=float("inf"))), r"rope_scaling\.factor=inf is invalid; it must be a finite "
                                                         r"number in \[1e-06, 1000000\.0\]"),
    (dict(rope_scaling=dict(YARN, beta_fast=[32])), r"rope_scaling\.beta_fast=\[32\] is invalid"),
    (dict(rope_scaling=dict(YARN, beta_slow=5e-324)), r"rope_scaling\.beta_slow=5e-324 is invalid"),
    (dict(rope_scaling=dict(YARN, truncate="no")), r"rope_scaling\.truncate='no' is invalid; it must be true or false"),
    (dict(rope_scaling=dict(YARN, rope_type={"a": 1})), r"rope_scaling\.rope_type=\{'a': 1\} is invalid; it must be a string"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -5}), r"rope_parameters\.rope_theta=-5 is invalid"),
    (dict(eos_token_id=151936), r"config\.json: eos_token_id=151936 holds id 151936 outside the vocabulary; ids must be in "
                                r"\[0, 151935\] \(vocab_size=151936\)"),
    (dict(eos_token_id=[1, -1]), r"config\.json: eos_token_id=\[1, -1\] holds id -1 outside the vocabulary"),
    (dict(bos_token_id=10**30), r"config\.json: bos_token_id=1000000000000000000000000000000 holds id"),
    (dict(tie_word_embeddings="yes"), r"tie_word_embeddings='yes' is invalid; it must be true or false"),
    (dict(use_sliding_window=True, sliding_window=2**40), r"sliding_window=1099511627776 is invalid"),
    (dict(use_sliding_window=True, sliding_window=64, layer_types="full"), r"layer_types='full' is invalid; it must be "
                                                                          r"a list of 28 strings"),
    (dict(architectures=None, model_type={"qwen3": 1}), r"model_type=\{'qwen3': 1\} is not supported"),
    (dict(torch_dtype=["bfloat16"]), r"torch_dtype=\['bfloat16'\] is invalid; it must be a string"),
    (dict(hidden_act=["silu"]), r"hidden_act=\['silu'\] is not supported"),
    (dict(partial_rotary_factor=True), r"partial_rotary_factor=True is invalid"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_config_values_are_range_checked(change, match):
    with pytest.raises(CheckpointError, match=r"config\.json: " + match if not match.startswith("config") else match):
        model_config_from_hf(dict(QWEN3_0_6B, **change))


def test_a_billion_layers_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1000000000"):
        model_config_from_hf(dict(QWEN3_0_6B, num_hidden_layers=10**9))
    assert time.perf_counter() - start < 1.0


_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
         "mlp_bias", "eos_token_id", "bos_token_id", "hidden_act", "architectures", "model_type", "sliding_window",
         "use_sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor", "quantization_config",
         "num_experts", "torch_dtype", "rope_scaling", "rope_parameters", "rope_scaling.factor",
         "rope_scaling.original_max_position_embeddings", "rope_scaling.beta_fast", "rope_scaling.beta_slow",
         "rope_scaling.attention_factor", "rope_scaling.mscale", "rope_scaling.mscale_all_dim", "rope_scaling.truncate",
         "rope_scaling.rope_type", "rope_scaling.type", "rope_scaling.low_freq_factor", "rope_scaling.high_freq_factor"]
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.sampled_from([0, 1, 2, 28, 64, 4096, 4097, 2**31, 2**63, 2**64, 10**100, -1, 1e-320, 0.5, 4.0])
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
            | st.sampled_from(["yarn", "llama3", "linear", "default", "dynamic", "silu", "Qwen3ForCausalLM", "qwen3",
                               "sliding_attention"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                               max_size=3), max_leaves=6)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=3), st.sampled_from(["qwen3", "llama", "qwen2"]))
def test_random_config_values_map_or_are_refused(changes, base):
    cfg = json.loads(json.dumps({"qwen3": QWEN3_YARN, "llama": LLAMA_3_2_1B, "qwen2": QWEN2_5_0_5B}[base]))
    for key, value in changes.items():
        if key.startswith("rope_scaling."):
            if not isinstance(cfg.get("rope_scaling"), dict):
                cfg["rope_scaling"] = {}
            cfg["rope_scaling"][key.split(".", 1)[1]] = value
        else:
            cfg[key] = value
    cfg = json.loads(json.dumps(cfg))  # what a file can hold (NaN and Infinity included)
    try:
        model, info = model_config_from_hf(cfg, max_context=4096)
    except CheckpointError as exc:
        assert "config.json" in str(exc) or "max_context" in str(exc)
        return
    assert 1 <= model.num_layers <= 4096 and all(0 <= i < model.vocab_size for i in info.eos_token_ids)
    assert np.all(np.isfinite(model.rope_scaling.inv_freq(model.head_dim, model.rope_theta))) if model.rope_scaling else True
