"""Model building blocks, config validation, weights, the dense references and batch buckets."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_harness import TOL_BF16
from ninfer_kv.models.decoder import (
    ModelConfig,
    StepConfig,
    dense_greedy_generate,
    dense_logits,
    init_dense_cache,
    init_params,
    make_dense_cache_steps,
    pad_rows,
    param_count,
    prompt_chunks,
)
from ninfer_kv.models.decoder.dense import dense_forward
from ninfer_kv.models.decoder.layers import apply_rope, gated_mlp, rms_norm
from ninfer_kv.schema.buckets import bucket_for


# -- layers ------------------------------------------------------------------------------------------


def test_rms_norm_normalizes_and_scales():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64)) * 7.0
    gain = jnp.linspace(0.5, 2.0, 64)
    y = rms_norm(x, gain, 1e-6)
    np.testing.assert_allclose(np.asarray(rms_norm(x, jnp.ones(64), 1e-6) ** 2).mean(-1), 1.0, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(y), np.asarray(rms_norm(x, jnp.ones(64), 1e-6) * gain), rtol=1e-5)
    assert rms_norm(x.astype(jnp.bfloat16), gain, 1e-6).dtype == jnp.bfloat16


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(0, 5000))
def test_rope_preserves_norm_and_depends_on_relative_position(m, n, shift):
    key = jax.random.PRNGKey(m % 7)
    q = jax.random.normal(key, (1, 1, 1, 64))
    k = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, 1, 64))

    def rot(x, p):
        return apply_rope(x, jnp.full((1, 1), p, jnp.int32), 10000.0)

    np.testing.assert_allclose(float(jnp.linalg.norm(rot(q, m))), float(jnp.linalg.norm(q)), rtol=1e-5)
    a = float(jnp.sum(rot(q, m) * rot(k, n)))
    b = float(jnp.sum(rot(q, m + shift) * rot(k, n + shift)))
    assert abs(a - b) < 2e-3 * (1 + abs(a))


def test_rope_at_position_zero_is_identity():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 4, 32))
    np.testing.assert_allclose(np.asarray(apply_rope(x, jnp.zeros((2, 3), jnp.int32), 1e4)), np.asarray(x), atol=1e-6)


def test_swiglu_matches_formula():
    r = np.random.default_rng(0)
    # projections are (out, in), as nn.Linear weights
    x, wg, wu, wd = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((2, 8), (16, 8), (16, 8), (8, 16)))
    silu = lambda z: z / (1 + jnp.exp(-z))  # noqa: E731
    want = (silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    np.testing.assert_allclose(np.asarray(gated_mlp(x, wg, wu, wd)), np.asarray(want), rtol=1e-5, atol=1e-5)


# -- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
        (dict(head_dim=63), "must be even"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(dtype="float16"), "not supported"),
        (dict(mtp=1), "must be a bool"),
    ],
)
def test_model_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(impl="cuda"), "impl='cuda'"),
        (dict(prefill_chunk=100), "multiple of the page size"),
        (dict(batch_buckets=(4, 2)), "strictly increasing"),
        (dict(profile="int8-g64", model=ModelConfig(head_dim=96)), "head_dim=96"),
        (dict(draft_window=0), "draft_window=0"),
    ],
)
def test_step_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        StepConfig(**kw)


def test_layouts_follow_the_model():
    cfg = ModelConfig(mtp=True)
    main, mtp = cfg.main_layout("k8v4"), cfg.mtp_layout("k8v4")
    assert (main.num_layers, main.num_kv_heads, main.head_dim) == (4, 2, 128)
    assert (mtp.num_layers, mtp.num_kv_heads, mtp.head_dim) == (1, 2, 128)
    assert main.profile == mtp.profile
    assert cfg.kv_config("bf16").num_layers == 4
    assert hash(StepConfig(model=cfg)) == hash(StepConfig(model=ModelConfig(mtp=True)))
    ModelConfig(head_dim=256).main_layout("int8-g64")  # head dim 256 is supported


# -- weights -----------------------------------------------------------------------------------------


def test_init_params_is_deterministic_and_seeded():
    cfg = ModelConfig.tiny(mtp=True)
    a, b, c = init_params(cfg, 3), init_params(cfg, 3), init_params(cfg, 4)
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(c["embed"]))
    assert len(a["layers"]) == cfg.num_layers and "mtp" in a
    chex.assert_shape(a["layers"][0]["wk"], (cfg.num_kv_heads * cfg.head_dim, cfg.d_model))  # (out, in)
    assert "mtp" not in init_params(ModelConfig.tiny(), 3)
    # Adding the MTP head does not change the main weights.
    chex.assert_trees_all_equal(init_params(ModelConfig.tiny(), 3)["layers"], a["layers"])
    with pytest.raises(ValueError, match="seed=-1"):
        init_params(cfg, -1)


def test_default_model_activations_are_o1_and_greedy_is_not_degenerate():
    cfg = ModelConfig()
    params = init_params(cfg, 0)
    assert param_count(params) > 4_000_000
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 40)
    h = dense_forward(params, cfg, prompt)
    rms = float(jnp.sqrt(jnp.mean(h * h)))
    assert 0.3 < rms < 5.0, rms
    tokens, logits = dense_greedy_generate(params, cfg, prompt, 16)
    assert np.unique(np.asarray(tokens)).size > 4
    assert 0.5 < float(jnp.std(logits)) < 10.0


def test_bfloat16_model_runs():
    cfg = ModelConfig.tiny(dtype="bfloat16")
    params = init_params(cfg, 0)
    assert params["embed"].dtype == jnp.bfloat16
    logits = dense_logits(params, cfg, np.arange(20) % cfg.vocab_size)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


# -- dense references --------------------------------------------------------------------------------


def test_greedy_generate_is_consistent_with_teacher_forced_logits():
    cfg = ModelConfig.tiny()
    params = init_params(cfg, 0)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 30))
    tokens, logits = dense_greedy_generate(params, cfg, prompt, 5)
    full = dense_logits(params, cfg, np.concatenate([prompt, np.asarray(tokens)], 1))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, 29:34]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(full[:, 29:34]), -1))


def test_dense_contiguous_cache_matches_no_cache_reference():
    cfg = ModelConfig.tiny()
    params = init_params(cfg, 0)
    b, s0, n = 2, 40, 6
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, (b, s0)).astype(np.int32)
    steps = make_dense_cache_steps(cfg)
    cache = init_dense_cache(cfg, b, 64)
    cache, tok = steps.prefill(params, cache, jnp.asarray(prompt), jnp.zeros((b,), jnp.int32))
    seq, logits = [np.asarray(tok)], []
    for i in range(n):
        cache, lg, tok = steps.decode(params, cache, jnp.asarray(seq[-1])[:, None], jnp.full((b,), s0 + i, jnp.int32))
        seq.append(np.asarray(tok))
        logits.append(np.asarray(lg))
    full_tokens = np.concatenate([prompt, np.stack(seq[:-1], 1)], 1)
    ref = dense_logits(params, cfg, full_tokens, "bf16")  # the cache stores bfloat16 K/V
    np.testing.assert_allclose(np.stack(logits, 1), np.asarray(ref[:, s0:]), atol=TOL_BF16)
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    chex.assert_shape(cache.k, (b, cfg.num_kv_heads, 64, cfg.head_dim))


# -- buckets -----------------------------------------------------------------------------------------


def test_bucket_for_and_prompt_chunks():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 32)] == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="exceeds the largest bucket 32"):
        bucket_for(33)
    assert prompt_chunks(150, 128) == [(0, 128), (128, 22)]
    assert prompt_chunks(128, 128) == [(0, 128)]


def test_pad_rows_builds_harmless_padding():
    p = pad_rows(np.array([[7, 8]]), [5], [2], [3], bucket=4, scratch_row=1)
    np.testing.assert_array_equal(p.tokens, [[7, 8], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(p.positions, [5, 0, 0, 0])
    np.testing.assert_array_equal(p.valid, [2, 0, 0, 0])
    np.testing.assert_array_equal(p.table_rows, [3, 1, 1, 1])
    assert p.num_real == 1 and all(a.dtype == np.int32 for a in p[:4])
    with pytest.raises(ValueError, match="valid must lie in"):
        pad_rows(np.array([[7, 8]]), [5], [3], [3], bucket=4)
    with pytest.raises(ValueError, match="bucket=1"):
        pad_rows(np.zeros((2, 1), np.int32), [0, 0], [1, 1], [0, 1], bucket=1)
