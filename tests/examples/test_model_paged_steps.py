"""Paged step functions of the example model against the dense references."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_harness import TOL_BF16, TOL_QUANT, copy_planes, greedy_decode, i32, make, prefill, random_tables
from ninfer_kv.models.decoder import ModelConfig, dense_greedy_generate, dense_logits, init_params, pad_rows
from ninfer_kv.ops.views import allocate_planes

C, L = 4, 4  # 4 execution rows, 256 tokens per row
NUM_PAGES = C * L + 5


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny()
    return cfg, init_params(cfg, seed=0)


@pytest.fixture(scope="module")
def bf16_steps(tiny):
    return make(tiny[0], "bf16", draft_window=3)


def _top2_gap(logits: np.ndarray) -> float:
    s = np.sort(np.asarray(logits), axis=-1)
    return float(np.min(s[..., -1] - s[..., -2]))


@pytest.mark.parametrize(
    "profile, head_dim, tol",
    [("bf16", 64, TOL_BF16), pytest.param("k8v4", 128, TOL_QUANT, marks=pytest.mark.slow)],
)
def test_chunked_prefill_and_decode_match_dense_greedy(profile, head_dim, tol):
    cfg = ModelConfig.tiny(head_dim=head_dim)
    params = init_params(cfg, seed=1)
    steps = make(cfg, profile)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, cfg.vocab_size, (2, 150)).astype(np.int32)  # 150: not a multiple of 64
    tables = random_tables(rng, C, L, NUM_PAGES)
    rows = [3, 1]
    num_new = 8

    planes = allocate_planes(steps.config.main_layout, NUM_PAGES)
    planes, first = prefill(steps, params, planes, tables, prompt, rows)
    planes, toks, logits, _ = greedy_decode(steps, params, planes, tables, first.next_tokens, 150, rows, num_new - 1)
    paged_tokens = np.concatenate([np.asarray(first.next_tokens)[:, None], toks], axis=1)
    paged_logits = np.concatenate([np.asarray(first.logits)[:, None], logits], axis=1)

    dense_tokens, dense_logits_ = dense_greedy_generate(params, cfg, prompt, num_new, profile)
    # Exact token equality is meaningful only when no greedy choice is a near tie.
    assert _top2_gap(dense_logits_) > 20 * tol, "seed produces a near tie; pick another seed"
    np.testing.assert_array_equal(paged_tokens, np.asarray(dense_tokens))
    np.testing.assert_allclose(paged_logits, np.asarray(dense_logits_), atol=tol, rtol=0)
    assert np.unique(paged_tokens[0]).size > 1


def test_quantized_paged_differs_from_bf16_dense(tiny):
    """The quantized comparison above can fail: the k8v4 cache is far from a BF16 one."""
    cfg, params = tiny
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 100))
    diff = jnp.max(jnp.abs(dense_logits(params, cfg, prompt, "k8v4") - dense_logits(params, cfg, prompt, "bf16")))
    assert float(diff) > 100 * TOL_QUANT


def test_verify_equals_k_plus_one_decode_steps(tiny, bf16_steps):
    cfg, params = tiny
    steps = bf16_steps
    k = steps.config.draft_window
    rng = np.random.default_rng(3)
    b = 4
    prompt = rng.integers(0, cfg.vocab_size, (b, 70)).astype(np.int32)
    tables = random_tables(rng, C, L, NUM_PAGES)
    rows = [2, 0, 3, 1]
    planes = allocate_planes(steps.config.main_layout, NUM_PAGES)
    planes, first = prefill(steps, params, planes, tables, prompt, rows)
    t0 = np.asarray(first.next_tokens)

    # The greedy continuation y1..y3 on a copy of the pool.
    _, y, _, _ = greedy_decode(steps, params, copy_planes(planes), tables, t0, 70, rows, k)
    wrong = (y + 1) % cfg.vocab_size
    drafts = np.stack(
        [
            [y[0, 0], y[0, 1], wrong[0, 2]],  # two accepted
            [wrong[1, 0], y[1, 1], y[1, 2]],  # none accepted
            [y[2, 0], y[2, 1], y[2, 2]],  # all three accepted
            [y[3, 0], y[3, 1], y[3, 2]],  # all correct but valid = 2: one accepted
        ]
    ).astype(np.int32)
    tokens = np.concatenate([t0[:, None], drafts], axis=1)
    valid = i32([k + 1, k + 1, k + 1, 2])

    # Teacher-forced decode of the same tokens, one step at a time.
    dec_planes = copy_planes(planes)
    dec_logits, dec_hidden = [], []
    for t in range(k + 1):
        out = steps.decode(params, dec_planes, jnp.asarray(tables), tokens[:, t : t + 1], i32([70 + t] * b), i32([1] * b), i32(rows))
        dec_planes = out.planes
        dec_logits.append(np.asarray(out.logits))
        dec_hidden.append(np.asarray(out.hidden[:, 0]))
    dec_logits = np.stack(dec_logits, 1)
    dec_hidden = np.stack(dec_hidden, 1)

    out = steps.verify(params, planes, jnp.asarray(tables), tokens, i32([70] * b), valid, i32(rows))
    chex.assert_shape(out.logits, (b, k + 1, cfg.vocab_size))
    ver_logits = np.asarray(out.logits)
    np.testing.assert_allclose(ver_logits[:3], dec_logits[:3], atol=TOL_BF16, rtol=0)
    np.testing.assert_allclose(ver_logits[3, :2], dec_logits[3, :2], atol=TOL_BF16, rtol=0)
    np.testing.assert_allclose(np.asarray(out.hidden)[:3], dec_hidden[:3], atol=TOL_BF16, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.target_tokens)[:3], np.argmax(dec_logits[:3], -1))
    np.testing.assert_array_equal(np.asarray(out.num_accepted), [2, 0, 3, 1])
    # The verify wrote the same K/V as the decode steps for the fully valid rows.
    for name in planes_names(steps):
        a = np.asarray(out.planes[name], np.float32)
        d = np.asarray(dec_planes[name], np.float32)
        pages = tables[rows[:3]].reshape(-1)
        np.testing.assert_allclose(a[:, pages], d[:, pages], atol=1e-2, rtol=1e-2)


def planes_names(steps):
    return steps.config.main_layout.plane_names


def test_steps_compile_once_per_bucket(tiny, bf16_steps):
    """Changing page IDs, rows, positions and valid counts never recompiles; a new bucket does, once."""
    cfg, params = tiny
    steps = bf16_steps
    rng = np.random.default_rng(11)
    layout = steps.config.main_layout

    def tables():
        return jnp.asarray(random_tables(rng, C, L, NUM_PAGES))  # new page IDs every call

    def ints(high, shape):
        return i32(rng.integers(0, high, shape))

    def run(bucket, planes):
        rows = ints(C, bucket)
        out = steps.prefill(params, planes, tables(), ints(cfg.vocab_size, (bucket, 128)), ints(64, bucket), ints(129, bucket), rows)
        out = steps.decode(params, out.planes, tables(), ints(cfg.vocab_size, (bucket, 1)), ints(200, bucket), ints(2, bucket), rows)
        out = steps.verify(params, out.planes, tables(), ints(cfg.vocab_size, (bucket, 4)), ints(200, bucket), ints(5, bucket), rows)
        return out.planes

    planes = allocate_planes(layout, NUM_PAGES)
    for bucket in (1, 2):
        planes = run(bucket, planes)  # compiles each step for this bucket unless already compiled
    before = steps.compiles()
    assert steps.traces() == before
    for _ in range(4):
        for bucket in (1, 2):
            planes = run(bucket, planes)
    jax.block_until_ready(planes)
    assert steps.compiles() == before and steps.traces() == before
    for step in steps.steps.values():  # every signature compiled exactly once
        assert set(step.counter.compiles_by_signature().values()) <= {1}
    # A bucket never used before is one new compile, and the counter sees it.
    n = steps.decode.compiles
    for _ in range(2):
        planes = steps.decode(params, planes, tables(), ints(cfg.vocab_size, (8, 1)), ints(200, 8), ints(2, 8), ints(C, 8)).planes
    assert steps.decode.compiles == n + 1 and steps.decode.traces == n + 1


def test_padding_rows_do_not_affect_real_rows(tiny, bf16_steps):
    cfg, params = tiny
    steps = bf16_steps
    rng = np.random.default_rng(5)
    tables = random_tables(rng, C, L, NUM_PAGES)
    prompt = rng.integers(0, cfg.vocab_size, (1, 70)).astype(np.int32)
    layout = steps.config.main_layout
    live_row = 1

    def run(bucket, garbage: bool):
        """Prefill + 3 decode steps of one real row padded to ``bucket`` (poisoned NaN pool)."""
        planes = allocate_planes(layout, NUM_PAGES, fill=float("nan"))
        tok = np.zeros((1, 128), np.int32)
        tok[0, :70] = prompt[0]
        padded = pad_rows(tok, [0], [70], [live_row], bucket=bucket, scratch_row=live_row)
        ptok = padded.tokens.copy()
        if garbage:
            ptok[1:] = rng.integers(0, cfg.vocab_size, ptok[1:].shape)
        out = steps.prefill(params, planes, jnp.asarray(tables), ptok, padded.positions, padded.valid, padded.table_rows)
        logits = [np.asarray(out.logits)]
        tok = np.asarray(out.next_tokens)[:1]
        planes = out.planes
        for i in range(3):
            p = pad_rows(tok[:, None], [70 + i], [1], [live_row], bucket=bucket, scratch_row=live_row)
            dtok = p.tokens.copy()
            if garbage:
                dtok[1:] = rng.integers(0, cfg.vocab_size, dtok[1:].shape)
            out = steps.decode(params, planes, jnp.asarray(tables), dtok, p.positions, p.valid, p.table_rows)
            planes = out.planes
            logits.append(np.asarray(out.logits))
            tok = np.asarray(out.next_tokens)[:1]
        return np.stack(logits, 1), {k: np.asarray(v) for k, v in planes.items()}

    l1, planes1 = run(1, False)
    l4a, planes4a = run(4, False)
    l4b, planes4b = run(4, True)
    assert np.all(np.isfinite(l4b))  # padding rows see no key: finite (zero attention) outputs
    np.testing.assert_array_equal(l4a[:1], l4b[:1])  # padding content is irrelevant to real rows
    np.testing.assert_allclose(l4a[:1], l1, atol=TOL_BF16, rtol=0)  # and so is the bucket
    for name in planes4a:  # padding rows wrote nothing (bitwise, NaN poison included)
        np.testing.assert_array_equal(planes4a[name].view(np.uint8), planes4b[name].view(np.uint8))
    # Only the real row's first 73 positions were written; every other page is still poison.
    k = planes4b["k"].astype(np.float32)
    written = tables[live_row, :2]
    untouched = np.setdiff1d(np.arange(NUM_PAGES), written)
    assert np.all(np.isnan(k[:, untouched]))
    assert np.all(np.isfinite(k[:, written[0]])) and np.all(np.isfinite(k[:, written[1], :, :9]))
    assert np.all(np.isnan(k[:, written[1], :, 9:]))


def test_steps_donate_planes_and_tables(tiny, bf16_steps):
    cfg, params = tiny
    steps = bf16_steps
    assert steps.decode.donate_argnums == (1, 2)
    planes = allocate_planes(steps.config.main_layout, NUM_PAGES)
    tables_np = random_tables(np.random.default_rng(0), C, L, NUM_PAGES)
    tables = jnp.asarray(tables_np)
    out = steps.decode(params, planes, tables, i32([[5]]), i32([0]), i32([1]), i32([0]))
    jax.block_until_ready(out)
    assert all(p.is_deleted() for p in planes.values())
    assert tables.is_deleted()
    np.testing.assert_array_equal(np.asarray(out.block_tables), tables_np)
    chex.assert_trees_all_equal_shapes_and_dtypes(out.planes, allocate_planes(steps.config.main_layout, NUM_PAGES))


def test_step_argument_errors(tiny, bf16_steps):
    cfg, params = tiny
    steps = bf16_steps
    planes = allocate_planes(steps.config.main_layout, NUM_PAGES)
    tables = jnp.zeros((C, L), jnp.int32)
    with pytest.raises(ValueError, match="not a bucket"):
        steps.decode(params, planes, tables, i32(np.zeros((3, 1))), i32([0] * 3), i32([1] * 3), i32([0] * 3))
    with pytest.raises(ValueError, match="positions must be int32"):
        steps.decode(params, planes, tables, i32([[1]]), np.array([0], np.int64), i32([1]), i32([0]))
    with pytest.raises(ValueError, match="expected 128 tokens"):
        steps.prefill(params, planes, tables, i32(np.zeros((1, 64))), i32([0]), i32([1]), i32([0]))
    with pytest.raises(ValueError, match="expected 4 tokens"):
        steps.verify(params, planes, tables, i32(np.zeros((1, 3))), i32([0]), i32([1]), i32([0]))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        steps.decode(params, planes, tables.astype(jnp.float32), i32([[1]]), i32([0]), i32([1]), i32([0]))
    assert not any(p.is_deleted() for p in planes.values())  # a rejected call consumes nothing
    assert not hasattr(steps, "mtp_draft")  # no MTP head in this config
