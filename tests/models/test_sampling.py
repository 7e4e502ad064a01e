"""Sampling inside the jitted steps: the filter against its numpy reference, the draw against the
Gumbel-max rule, and determinism across runs, batch compositions, forks and speculative verify."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.models.decoder import ModelConfig, SamplingConfig, init_params, make_steps, StepConfig
from ninfer_kv.models.decoder.sampling import (
    SamplingRows,
    filter_logits,
    filter_logits_reference,
    sample_tokens,
    sampling_rows,
    sequence_key,
)
from ninfer_kv.models.generate import PagedGenerator
from ninfer_kv.ops.views import allocate_planes


def test_filter_matches_the_reference():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 300)).astype(np.float32) * 3
    temp = np.array([0.7, 1.0, 2.0, 0.5, 1.3, 0.0], np.float32)
    top_k = np.array([0, 5, 40, 0, 300, 7], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.05, 0.999, 0.3], np.float32)
    got = np.asarray(filter_logits(logits, temp, top_k, top_p))
    for i in range(6):
        want = filter_logits_reference(logits[i], float(temp[i]), int(top_k[i]), float(top_p[i]))
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {i}")
        np.testing.assert_allclose(got[i][np.isfinite(got[i])], want[np.isfinite(want)], rtol=1e-6)
    kept = np.isfinite(got).sum(axis=1)
    assert kept[1] == 5 and kept[5] <= 7 and kept[3] >= 1
    # no limits: nothing is cut, only scaled
    np.testing.assert_allclose(np.asarray(filter_logits(logits[:1], [2.0], [0], [1.0])), logits[:1] / 2, rtol=1e-6)


def test_the_draw_is_gumbel_max_over_the_kept_logits_with_the_position_folded_key():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    cfgs = [SamplingConfig(0.8, 10, 0.9, seed=4), SamplingConfig(0.0, seed=4), SamplingConfig(1.5, 0, 1.0, seed=9)]
    sp = sampling_rows(cfgs, 3)
    positions = np.array([17, 17, 3], np.int32)
    got = np.asarray(sample_tokens(logits, sp, positions))
    for i, c in enumerate(cfgs):
        if c.greedy:
            assert got[i] == np.argmax(logits[i])
            continue
        key = jax.random.fold_in(jax.random.key(c.seed, impl="threefry2x32"), int(positions[i]))
        noise = np.asarray(jax.random.gumbel(key, (50,), jnp.float32))
        kept = filter_logits_reference(logits[i], c.temperature, c.top_k, c.top_p)
        assert got[i] == np.argmax(kept + noise)


def test_sampled_frequencies_follow_the_filtered_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))[None].repeat(4000, 0)
    sp = SamplingRows(np.full(4000, 1.0, np.float32), np.zeros(4000, np.int32), np.full(4000, 0.9, np.float32),
                        np.tile(sequence_key(7), (4000, 1)))
    tokens = np.asarray(jax.jit(sample_tokens)(logits, sp, np.arange(4000, dtype=np.int32)))  # positions differ
    freq = np.bincount(tokens, minlength=4) / 4000
    # top-p 0.9 keeps {0.5, 0.3, 0.15}: renormalized 0.526, 0.316, 0.158; token 3 never drawn
    np.testing.assert_allclose(freq, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], atol=0.03)
    assert freq[3] == 0


def test_sampling_config_refuses_bad_values():
    for kw, match in [(dict(temperature=-1), "temperature=-1"), (dict(top_p=0.0), "top_p=0.0"),
                      (dict(top_k=-2), "top_k=-2"), (dict(seed=2**32), "seed=4294967296"),
                      (dict(temperature=10**400), "temperature=1000"), (dict(temperature=float("nan")), "temperature=nan"),
                      (dict(temperature=np.bool_(True)), "temperature=.*True"), (dict(top_p=float("nan")), "top_p=nan"),
                      (dict(top_p=10**400), "top_p=1000"), (dict(top_k=1.0), "top_k=1.0"), (dict(seed="7"), "seed='7'")]:
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**kw)
    assert SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint32(9)) == SamplingConfig(0.5, 3, 1.0, 9)


# -- determinism through the paged store -----------------------------------------------------------------

SAMPLED = SamplingConfig(temperature=1.0, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny()
    return cfg, init_params(cfg, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(1, 256, n).tolist() for n in (90, 20, 150)]


def _gen(model, **kw):
    cfg, params = model
    return PagedGenerator(params, cfg, max_context=256, max_batch=4, **kw)


def test_fixed_seed_same_tokens_across_runs_and_batch_compositions(model, prompts):
    alone = _gen(model).generate([prompts[0]], max_new_tokens=10, sampling=SAMPLED)[0].generated
    again = _gen(model).generate([prompts[0]], max_new_tokens=10, sampling=SAMPLED)[0].generated
    assert alone == again
    others = [SamplingConfig(0.9, seed=1), SAMPLED, SamplingConfig()]
    mixed = _gen(model).generate([prompts[1], prompts[0], prompts[2]], max_new_tokens=10, sampling=others)
    assert mixed[1].generated == alone  # row 1 of a batch of 3 (and a greedy neighbour)
    assert len(set(alone)) > 3
    other_seed = _gen(model).generate([prompts[0]], max_new_tokens=10,
                                      sampling=SamplingConfig(1.0, 40, 0.95, seed=4321))[0].generated
    assert other_seed != alone


def test_fixed_seed_same_tokens_across_forks(model, prompts):
    gen = _gen(model)
    whole = gen.generate([prompts[2]], max_new_tokens=12, sampling=SAMPLED)[0].generated
    # a checkpoint of the prompt's first 100 tokens, forked with the whole prompt (COW of its tail page)
    parent = gen.add(prompts[2][:100], max_new_tokens=1, retain=True)
    gen.run()
    fork = gen.add(prompts[2], max_new_tokens=12, sampling=SAMPLED, source=parent)
    gen.run()
    assert fork.generated == whole
    # a checkpoint in the middle of the generation: the fork continues with the same tokens
    mid = gen.add(prompts[2], max_new_tokens=5, sampling=SAMPLED, retain=True)
    gen.run()
    assert mid.generated == whole[:5]
    cont = gen.add(prompts[2] + whole[:5], max_new_tokens=7, sampling=SAMPLED, source=mid)
    gen.run()
    assert cont.generated == whole[5:]
    gen.release(parent), gen.release(mid)
    gen.store.audit_invariants()
    assert gen.store.pool("main").allocated == 0


def test_stop_tokens_end_a_sequence(model, prompts):
    greedy = _gen(model).generate([prompts[1]], max_new_tokens=8)[0]
    assert greedy.finish_reason == "length" and len(greedy.generated) == 8
    stop = greedy.generated[3]
    first = greedy.generated.index(stop)
    ended = _gen(model).generate([prompts[1]], max_new_tokens=8, stop_tokens=[stop])[0]
    assert ended.finish_reason == "stop" and ended.generated == greedy.generated[: first + 1]


def test_verify_samples_the_tokens_decode_would(model, prompts):
    """With sampling, verify's targets are the tokens decode would sample at the same positions, so a
    speculative round accepts exactly the drafts that plain sampled decoding produces."""
    cfg, params = model
    plain = _gen(model).generate([prompts[0]], max_new_tokens=5, sampling=SAMPLED)[0].generated
    steps = make_steps(StepConfig(model=cfg, draft_window=3, batch_buckets=(1,)))
    layout = steps.config.main_layout
    planes = allocate_planes(layout, 8)
    tables = jnp.asarray(np.arange(8, dtype=np.int32).reshape(1, 8))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    sp = sampling_rows([SAMPLED], 1)
    prompt = np.asarray(prompts[0], np.int32)
    chunk = np.zeros((1, 128), np.int32)
    chunk[0, :90] = prompt
    out = steps.prefill(params, planes, tables, chunk, i32([0]), i32([90]), i32([0]), sp)
    assert int(out.next_tokens[0]) == plain[0]
    drafts = [plain[1], plain[2], (plain[3] + 1) % 256]  # two right, one wrong
    tokens = i32([[plain[0]] + drafts])
    v = steps.verify(params, out.planes, out.block_tables, tokens, i32([90]), i32([4]), i32([0]), sp)
    assert int(v.num_accepted[0]) == 2
    assert np.asarray(v.target_tokens)[0, :3].tolist() == plain[1:4]
