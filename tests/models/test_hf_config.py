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
from ninfer_kv.models.hf import hf_config_dict
from ninfer_kv.models.hf.published_configs import (
    GEMMA_2_2B,
    GEMMA_3_1B_IT,
    LLAMA_2_7B,
    LLAMA_3_2_1B,
    MISTRAL_7B_V0_3,
    QWEN2_5_0_5B,
    QWEN3_0_6B,
)
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
    (GEMMA_2_2B, 26, 4, 256, True, 2.02e9),
    (GEMMA_3_1B_IT, 26, 1, 256, True, 0.698e9),
], ids=["qwen3-0.6b", "llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b-v0.3", "llama-2-7b", "gemma-2-2b", "gemma-3-1b-it"])
def test_real_configs_map_and_plan(cfg, layers, kv_heads, head_dim, tied, non_embedding):
    model, info = model_config_from_hf(cfg)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.tie_embeddings) == (layers, kv_heads, head_dim, tied)
    eos = cfg["eos_token_id"]
    assert info.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    shapes = param_shapes(model)  # nothing allocated
    embedding = model.vocab_size * model.d_model * (1 if tied else 2)
    assert abs(param_count(shapes) - embedding - non_embedding) / non_embedding < 0.01  # the published sizes
    plan = plan_kv_cache(model.kv_config("k8v4"), max_context=2048, max_concurrency=8,
                         policy=ExplicitCapacity(8 * 2048))
    d = model.head_dim
    per_token_head = (d + 2) + (d // 2 + d // 16)  # K: FP8 row + scale; V: NVFP4 + scales
    main_layers = layers - len(model.ring_layers)  # the windowed layers of Gemma keep their K/V in rings
    assert model.main_layout("k8v4").page_bytes == 64 * main_layers * kv_heads * per_token_head
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


def _sliding_layers(model) -> list[int]:
    return [i for i in range(model.num_layers) if model.layer_window(i) is not None]


def test_sliding_windows_map_to_the_layers_transformers_slides():
    mistral_v01 = dict(MISTRAL_7B_V0_3, sliding_window=4096, rope_theta=10000.0)
    model, info = model_config_from_hf(mistral_v01)  # context 32768: every layer attends to its last 4096 positions
    assert info.max_context == 32768 and model.sliding_window == 4096 and _sliding_layers(model) == list(range(32))
    assert model.attention_options(0) == {"window": 4096}
    model, _ = model_config_from_hf(mistral_v01, max_context=4096)  # within the window: full attention
    assert (model.sliding_window, model.layer_types, model.attention_options(0)) == (None, None, {})
    # Qwen2.5's sliding_window is inert while use_sliding_window is false
    model, _ = model_config_from_hf(QWEN2_5_0_5B, max_context=32768)
    assert model.layer_types is None and model.sliding_window is None
    qwen_windows = dict(QWEN2_5_0_5B, use_sliding_window=True, max_window_layers=21)
    model, _ = model_config_from_hf(qwen_windows, max_context=65536)
    assert model.sliding_window == 32768 and _sliding_layers(model) == [21, 22, 23]
    no_key = {k: v for k, v in qwen_windows.items() if k != "sliding_window"}
    assert model_config_from_hf(no_key, max_context=65536)[0].sliding_window == 4096  # transformers' default
    assert model_config_from_hf(dict(qwen_windows, sliding_window=None), max_context=65536)[0].sliding_window is None
    # layer_types, when given, win over max_window_layers
    types = ["sliding_attention" if i % 3 == 0 else "full_attention" for i in range(24)]
    model, _ = model_config_from_hf(dict(qwen_windows, layer_types=types), max_context=65536)
    assert _sliding_layers(model) == list(range(0, 24, 3))
    # Gemma 2: even layers; Gemma 3: all but every 6th
    model, _ = model_config_from_hf(GEMMA_2_2B)
    assert model.sliding_window == 4096 and _sliding_layers(model) == list(range(0, 26, 2))
    assert model.attention_options(0) == {"window": 4096, "soft_cap": 50.0, "sm_scale": 256 ** -0.5}
    assert model.attention_options(1) == {"soft_cap": 50.0, "sm_scale": 256 ** -0.5}
    model, _ = model_config_from_hf(GEMMA_3_1B_IT)
    assert model.sliding_window == 512 and _sliding_layers(model) == [i for i in range(26) if (i + 1) % 6]
    assert model.attention_options(5) == {"sm_scale": 256 ** -0.5}
    # a window at least the context: no window, but Gemma 3's sliding layers keep their local RoPE
    model, _ = model_config_from_hf(GEMMA_3_1B_IT, max_context=512)
    assert model.sliding_window is None and _sliding_layers(model) == []
    assert model.layer_rope(0) == (10000.0, None) and model.layer_rope(5) == (1000000.0, None)
    model, _ = model_config_from_hf(GEMMA_2_2B, max_context=4096)
    assert model.sliding_window is None and model.layer_types is None


@pytest.mark.parametrize("base, changes", [
    (GEMMA_2_2B, {}),
    (GEMMA_2_2B, {"layer_types": ["full_attention"] * 13 + ["sliding_attention"] * 13}),
    (GEMMA_3_1B_IT, {}),
    (GEMMA_3_1B_IT, {"sliding_window_pattern": 4}),
    (QWEN2_5_0_5B, {"use_sliding_window": True, "max_window_layers": 21}),
    (QWEN2_5_0_5B, {"use_sliding_window": True, "max_window_layers": 30}),
    (QWEN2_5_0_5B, {"use_sliding_window": False, "max_window_layers": 3}),
    (QWEN3_0_6B, {"use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 20}),
], ids=["gemma2", "gemma2-layer-types", "gemma3", "gemma3-pattern-4", "qwen2-21", "qwen2-30", "qwen2-off", "qwen3"])
def test_sliding_layers_are_transformers_own(base, changes):
    """The sliding layers and window are the ones transformers' own config class derives."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(base, **changes)
    model, _ = model_config_from_hf(cfg, max_context=65536)
    classes = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    theirs = getattr(transformers, classes[cfg["model_type"]])(**{k: v for k, v in cfg.items() if k != "architectures"})
    window = theirs.sliding_window
    want = [i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention" and window is not None]
    assert _sliding_layers(model) == want and model.sliding_window == (window if want else None)


def test_gemma_options():
    g2, info = model_config_from_hf(GEMMA_2_2B)
    assert info.family == "gemma2" and not g2.qk_norm and g2.tie_embeddings
    assert (g2.attn_soft_cap, g2.final_soft_cap, g2.query_scale) == (50.0, 30.0, 1 / 16)
    assert (g2.gemma_norms, g2.sandwich_norms, g2.embed_scale, g2.mlp_activation) == (True, True, True, "gelu_tanh")
    assert (g2.rope_theta, g2.rope_scaling, g2.local_rope_theta) == (10000.0, None, None)
    g3, info = model_config_from_hf(GEMMA_3_1B_IT)
    assert info.family == "gemma3" and info.eos_token_ids == (1, 106) and g3.qk_norm
    assert (g3.attn_soft_cap, g3.final_soft_cap, g3.query_scale) == (None, None, 1 / 16)
    assert (g3.rope_theta, g3.rope_scaling, g3.local_rope_theta, g3.local_rope_scaling) == (1e6, None, 1e4, None)
    # the defaults of transformers' config classes for what a config.json leaves out
    bare = {k: v for k, v in GEMMA_2_2B.items() if k not in ("head_dim", "tie_word_embeddings", "query_pre_attn_scalar",
                                                                "attn_logit_softcapping", "final_logit_softcapping",
                                                                "sliding_window", "hidden_act", "hidden_activation")}
    assert model_config_from_hf(bare)[0] == g2
    # Gemma 3 ignores attn_logit_softcapping, as transformers' Gemma 3 attention does
    assert model_config_from_hf(dict(GEMMA_3_1B_IT, attn_logit_softcapping=50.0))[0] == g3
    assert model_config_from_hf(dict(GEMMA_2_2B, attn_logit_softcapping=None))[0].attn_soft_cap is None


GEMMA_3_SCALED_HUB = dict(GEMMA_3_1B_IT, rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA_3_SCALED_V5 = {**{k: v for k, v in GEMMA_3_1B_IT.items() if k not in ("rope_theta", "rope_local_base_freq",
                                                                               "rope_scaling", "sliding_window_pattern")},
                     "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)],
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}


def test_gemma3_reads_both_rope_spellings_as_transformers_converts_them():
    hub, _ = model_config_from_hf(GEMMA_3_SCALED_HUB)
    v5, _ = model_config_from_hf(GEMMA_3_SCALED_V5)
    assert hub == v5
    assert (hub.rope_theta, hub.rope_scaling.kind, hub.rope_scaling.factor) == (1e6, "linear", 8.0)
    assert (hub.local_rope_theta, hub.local_rope_scaling) == (10000.0, None)  # rope_scaling: the global layers only
    assert hub.layer_rope(0) == (10000.0, None) and hub.layer_rope(5) == (1e6, hub.rope_scaling)
    # rope_scaling also updates a given rope_parameters' full-attention entry, as transformers does
    both, _ = model_config_from_hf(dict(GEMMA_3_SCALED_V5, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert both.rope_scaling.factor == 4.0 and both.local_rope_theta == 10000.0
    transformers = pytest.importorskip("transformers")
    for cfg, model in ((GEMMA_3_SCALED_HUB, hub), (GEMMA_3_SCALED_V5, v5)):
        theirs = transformers.Gemma3TextConfig(**{k: v for k, v in cfg.items() if k != "architectures"}).rope_parameters
        assert theirs["full_attention"]["rope_theta"] == model.rope_theta
        assert theirs["full_attention"]["rope_type"] == "linear" and theirs["full_attention"]["factor"] == 8.0
        assert theirs["sliding_attention"]["rope_theta"] == model.local_rope_theta
        assert theirs["sliding_attention"]["rope_type"] == "default"


@pytest.mark.parametrize("cfg, family, context", [
    (GEMMA_2_2B, "gemma2", 8192), (GEMMA_3_SCALED_HUB, "gemma3", 32768), (GEMMA_3_1B_IT, "gemma3", 512),
    (dict(MISTRAL_7B_V0_3, sliding_window=4096), "mistral", 32768),
    (dict(QWEN2_5_0_5B, use_sliding_window=True, max_window_layers=21, sliding_window=4096), "qwen2", 32768),
], ids=["gemma2", "gemma3", "gemma3-no-window", "mistral", "qwen2"])
def test_hf_config_dict_writes_what_maps_back(cfg, family, context):
    model, _ = model_config_from_hf(cfg, max_context=context)
    again, _ = model_config_from_hf(hf_config_dict(model, family, max_position_embeddings=context))
    assert again == model


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
    (dict(use_sliding_window=True, sliding_window=0), r"sliding_window=0 is invalid; it must be an integer in "
                                                      r"\[1, 2147483584\]"),
    (dict(use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention"] * 27),
     r"layer_types=\[.* is invalid; it must be a list of 28 strings"),
    (dict(use_sliding_window=True, sliding_window=64, layer_types=["chunked_attention"] * 28),
     r"layer_types\[0\]='chunked_attention' is not supported: supported layer types: sliding_attention, full_attention"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_config_values_are_range_checked(change, match):
    with pytest.raises(CheckpointError, match=r"config\.json: " + match if not match.startswith("config") else match):
        model_config_from_hf(dict(QWEN3_0_6B, **change))


@pytest.mark.parametrize("base, change, match", [
    (GEMMA_2_2B, dict(attn_logit_softcapping=0), r"attn_logit_softcapping=0 is invalid; it must be null or a finite "
                                                 r"number in \[1e-06, 1000000\.0\]"),
    (GEMMA_2_2B, dict(attn_logit_softcapping=float("inf")), r"attn_logit_softcapping=inf is invalid"),
    (GEMMA_2_2B, dict(final_logit_softcapping="30"), r"final_logit_softcapping='30' is invalid"),
    (GEMMA_2_2B, dict(final_logit_softcapping=1e7), r"final_logit_softcapping=10000000\.0 is invalid"),
    (GEMMA_2_2B, dict(final_logit_softcapping=True), r"final_logit_softcapping=True is invalid"),
    (GEMMA_3_1B_IT, dict(attn_logit_softcapping=-1.0), r"attn_logit_softcapping=-1\.0 is invalid"),
    (GEMMA_2_2B, dict(query_pre_attn_scalar=0), r"query_pre_attn_scalar=0 is invalid; it must be a finite number in "
                                                r"\[1e-06, 1000000000000\.0\]"),
    (GEMMA_2_2B, dict(query_pre_attn_scalar=float("nan")), r"query_pre_attn_scalar=nan is invalid"),
    (GEMMA_2_2B, dict(query_pre_attn_scalar=None), r"query_pre_attn_scalar=None is invalid"),
    (GEMMA_2_2B, dict(sliding_window=-4096), r"sliding_window=-4096 is invalid"),
    (GEMMA_2_2B, dict(layer_types=["sliding_attention"] * 25), r"layer_types=.* is invalid; it must be a list of 26"),
    (GEMMA_2_2B, dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported: the MLP must be GELU "
                                                 r"with the tanh approximation"),
    (GEMMA_2_2B, dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True is not supported"),
    (GEMMA_3_1B_IT, dict(use_bidirectional_attention="yes"), r"use_bidirectional_attention='yes' is invalid"),
    (GEMMA_3_1B_IT, dict(sliding_window_pattern=0), r"sliding_window_pattern=0 is invalid; it must be an integer in "
                                                    r"\[1, 2147483647\]"),
    (GEMMA_3_1B_IT, dict(sliding_window_pattern=None), r"sliding_window_pattern=None is invalid"),
    (GEMMA_3_1B_IT, dict(rope_local_base_freq=0.5), r"rope_local_base_freq=0\.5 is invalid; it must be a finite "
                                                    r"number in \(1, 1e\+12\]"),
    (GEMMA_3_1B_IT, dict(rope_theta=float("inf")), r"rope_theta=inf is invalid"),
    (GEMMA_3_1B_IT, dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     r"rope_scaling\.rope_type='dynamic' is not supported"),
    (GEMMA_3_1B_IT, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
     r"rope_parameters=.* is not supported: Gemma 3 takes RoPE parameters per layer type"),
    (GEMMA_3_1B_IT, dict(rope_parameters={"full_attention": [1]}), r"rope_parameters\.full_attention=\[1\] is invalid"),
    (GEMMA_3_1B_IT, dict(rope_parameters={"sliding_attention": {"rope_theta": -1}}),
     r"rope_parameters\.sliding_attention\.rope_theta=-1 is invalid"),
    (dict(MISTRAL_7B_V0_3, sliding_window=4096), dict(layer_types=["sliding_attention", "full_attention"] * 16),
     r"layer_types=.* is not supported: MistralForCausalLM slides every layer"),
    (dict(GEMMA_3_1B_IT, architectures=["Gemma3ForConditionalGeneration"]), {}, r"architectures=.* is not supported"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) and v else None)
def test_window_and_gemma_values_are_range_checked(base, change, match):
    error = UnsupportedModelError if "is not supported" in match else CheckpointError
    with pytest.raises(error, match=r"config\.json: " + match):
        model_config_from_hf(dict(base, **change), max_context=8192)


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
         "rope_scaling.rope_type", "rope_scaling.type", "rope_scaling.low_freq_factor", "rope_scaling.high_freq_factor",
         "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation",
         "sliding_window_pattern", "rope_local_base_freq", "use_bidirectional_attention"]
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.sampled_from([0, 1, 2, 28, 64, 4096, 4097, 2**31, 2**63, 2**64, 10**100, -1, 1e-320, 0.5, 4.0])
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
            | st.sampled_from(["yarn", "llama3", "linear", "default", "dynamic", "silu", "Qwen3ForCausalLM", "qwen3",
                               "sliding_attention", "full_attention", "gelu_pytorch_tanh", "gemma3_text",
                               "Gemma3ForCausalLM"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                               max_size=3), max_leaves=6)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=3),
       st.sampled_from(["qwen3", "llama", "qwen2", "gemma2", "gemma3"]))
def test_random_config_values_map_or_are_refused(changes, base):
    cfg = json.loads(json.dumps({"qwen3": QWEN3_YARN, "llama": LLAMA_3_2_1B, "qwen2": QWEN2_5_0_5B, "gemma2": GEMMA_2_2B,
                                 "gemma3": GEMMA_3_SCALED_HUB}[base]))
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
    for layer in (0, model.num_layers - 1):
        theta, scaling = model.layer_rope(layer)
        assert np.all(np.isfinite(scaling.inv_freq(model.head_dim, theta))) if scaling else True
        assert all(np.isfinite(v) and v > 0 for v in model.attention_options(layer).values())
