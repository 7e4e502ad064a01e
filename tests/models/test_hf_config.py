"""``config.json`` of real models mapped onto the decoder: real sizes plan (and load, in the slow sweep)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.models.decoder import param_count, param_shapes
from ninfer_kv.models.decoder.layers import scaled_inv_freq
from ninfer_kv.models.hf import UnsupportedModelError, model_config_from_hf
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
