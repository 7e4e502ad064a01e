"""The decoder's per-layer attention options (sliding windows, soft caps, query scale) and Gemma's layer
options, without a checkpoint: the paged steps, the no-cache dense reference and the contiguous-cache
reference agree, and every option changes the result; :class:`ModelConfig` validates each option."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.models.decoder import (
    ModelConfig,
    dense_logits,
    init_dense_cache,
    init_params,
    make_dense_cache_steps,
)
from ninfer_kv.models.decoder.config import RopeScaling
from ninfer_kv.models.generate import PagedGenerator

GEMMA = ModelConfig.tiny(num_layers=3, qk_norm=True, tie_embeddings=True,
                         layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=40,
                         attn_soft_cap=4.0, final_soft_cap=8.0, query_scale=0.2, gemma_norms=True, sandwich_norms=True,
                         mlp_activation="gelu_tanh", embed_scale=True, local_rope_theta=1000.0,
                         rope_scaling=RopeScaling("linear", 4.0))
TOL = 2e-4  # the paged and dense float32 forwards: float32 rounding of different matmul shapes


@pytest.fixture(scope="module")
def params():
    return init_params(GEMMA, seed=3)


def test_paged_steps_equal_the_dense_reference(params):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, GEMMA.vocab_size, n).tolist() for n in (30, 110)]
    gen = PagedGenerator(params, GEMMA, max_context=256, max_batch=2, keep_logits=True)
    seqs = gen.generate(prompts, max_new_tokens=4)
    full = {}
    for prompt, seq in zip(prompts, seqs):
        tokens = prompt + seq.generated[:-1]
        full[len(prompt)] = np.asarray(dense_logits(params, GEMMA, tokens))[0]
        want = full[len(prompt)][len(prompt) - 1:]
        np.testing.assert_allclose(np.stack([np.asarray(x) for x in seq.logits]), want, atol=TOL, rtol=0)
        assert seq.generated == np.argmax(want, -1).tolist()
        assert np.abs(want).max() <= GEMMA.final_soft_cap  # the final soft cap bounds every logit
    tokens = prompts[1] + seqs[1].generated[:-1]
    for change in (dict(sliding_window=None), dict(attn_soft_cap=None), dict(final_soft_cap=None),
                   dict(local_rope_theta=None)):
        other = np.asarray(dense_logits(params, dataclasses.replace(GEMMA, **change), tokens))[0]
        assert np.abs(other - full[110]).max() > 100 * TOL, f"{change} changes nothing"


def test_the_contiguous_cache_applies_each_layers_options(params):
    b, s0, n = 2, 60, 4
    prompt = np.random.default_rng(1).integers(0, GEMMA.vocab_size, (b, s0)).astype(np.int32)
    steps = make_dense_cache_steps(GEMMA)
    cache, tok = steps.prefill(params, init_dense_cache(GEMMA, b, 128), jnp.asarray(prompt), jnp.zeros((b,), jnp.int32))
    seq, logits = [np.asarray(tok)], []
    for i in range(n):
        cache, lg, tok = steps.decode(params, cache, jnp.asarray(seq[-1])[:, None], jnp.full((b,), s0 + i, jnp.int32))
        seq.append(np.asarray(tok))
        logits.append(np.asarray(lg))
    ref = dense_logits(params, GEMMA, np.concatenate([prompt, np.stack(seq[:-1], 1)], 1), "bf16")
    np.testing.assert_allclose(np.stack(logits, 1), np.asarray(ref[:, s0:]), atol=TOL, rtol=0)


def test_per_layer_choices():
    assert [GEMMA.layer_window(i) for i in range(3)] == [40, None, 40]
    assert GEMMA.attention_options(0) == {"window": 40, "soft_cap": 4.0, "sm_scale": 0.2}
    assert GEMMA.attention_options(1) == GEMMA.attention_options(None) == {"soft_cap": 4.0, "sm_scale": 0.2}
    assert GEMMA.layer_rope(0) == (1000.0, None) and GEMMA.layer_rope(1) == (10000.0, GEMMA.rope_scaling)
    plain = ModelConfig.tiny()
    assert plain.attention_options(0) == {} and plain.layer_window(1) is None and plain.layer_rope(0) == (10000.0, None)
    # the windowed layers keep their K/V in window rings, the global one in the Main pool
    assert GEMMA.ring_layers == (0, 2) and [GEMMA.kv_slot(i) for i in range(3)] == [(True, 0), (False, 0), (True, 1)]
    kv = GEMMA.kv_config()
    assert GEMMA.main_layout().num_layers == kv.num_layers == 1
    assert (kv.rings.num_layers, kv.rings.window, kv.rings.step_tokens) == (2, 40, GEMMA.ring_step_tokens)
    whole = dataclasses.replace(GEMMA, window_rings=False)
    assert whole.ring_layers == () and whole.kv_config().rings is None and whole.main_layout().num_layers == 3
    every = dataclasses.replace(GEMMA, layer_types=("sliding_attention",) * 3)
    assert every.ring_layers == () and every.main_layout().num_layers == 3  # no global layer: all in Main


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=("sliding_attention",)), r"layer_types has 1 entries; it must have one per layer \(2\)"),
    (dict(layer_types=("sliding_attention", "chunked")), r"layer_types\[1\]='chunked' is not supported; allowed: "
                                                         r"sliding_attention, full_attention"),
    (dict(layer_types="sliding_attention"), r"layer_types='sliding_attention' must be None or a tuple of 2"),
    (dict(sliding_window=0), r"sliding_window=0 is invalid; it must be an integer in \[1, 2147483647\]"),
    (dict(sliding_window=2**31), r"sliding_window=2147483648 is invalid"),
    (dict(sliding_window=4.0), r"sliding_window=4\.0 is invalid"),
    (dict(attn_soft_cap=0.0), r"attn_soft_cap=0\.0 is invalid; it must be a finite number > 0"),
    (dict(final_soft_cap=float("inf")), r"final_soft_cap=inf is invalid"),
    (dict(query_scale=-1.0), r"query_scale=-1\.0 is invalid"),
    (dict(mlp_activation="gelu"), r"mlp_activation='gelu' is not supported; allowed: silu, gelu_tanh"),
    (dict(gemma_norms=1), r"gemma_norms=1 must be a bool"),
    (dict(local_rope_theta=1.0), r"local_rope_theta=1\.0 must be > 1"),
    (dict(local_rope_scaling=RopeScaling("linear", 2.0)), r"local_rope_scaling needs local_rope_theta"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_options_are_validated(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.tiny(**change)


def test_a_generator_fork_resumes_the_window_rings_from_their_snapshot(params):
    """A retained sequence's rings are copied to a snapshot slot; a fork on another row resumes them
    (small rings that wrap: 3 pages), and gives the tokens of the same prompt run from scratch."""
    small = dataclasses.replace(GEMMA, ring_step_tokens=64)
    gen = PagedGenerator(params, small, max_context=512, max_batch=2, prefill_chunk=64, keep_logits=True)
    assert gen.plan.rings.spec.pages_per_row == 3 and gen.plan.rings.spec.snapshots == 2
    prompt = np.random.default_rng(4).integers(0, GEMMA.vocab_size, 300).tolist()
    first = gen.add(prompt, max_new_tokens=3, retain=True)
    gen.run()
    fork = gen.add(first.tokens[:-1] + [7, 8], max_new_tokens=3, source=first)
    gen.run()
    fresh = PagedGenerator(params, small, max_context=512, max_batch=2, prefill_chunk=64, keep_logits=True)
    alone = fresh.add(first.tokens[:-1] + [7, 8], max_new_tokens=3)
    fresh.run()
    assert fork.generated == alone.generated
    np.testing.assert_allclose(np.stack(fork.logits), np.stack(alone.logits), atol=TOL, rtol=0)
    assert gen.snapshots.restored == 1
    gen.release(first)
    assert gen.snapshots.free_slots == 2
