"""The MTP head: paged extend and drafting against the dense MTP reference; its own pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from model_harness import TOL_BF16, i32, make, prefill, random_tables
from ninfer_kv.models.decoder import ModelConfig, dense_mtp_forward, init_params
from ninfer_kv.models.decoder.dense import dense_forward
from ninfer_kv.ops.views import allocate_planes

C, L = 2, 4
NUM_MAIN_PAGES = C * L + 2
K = 3
NUM_MTP_PAGES = NUM_MAIN_PAGES + C * -(-(K - 1) // 64)  # M + C * ceil((K - 1) / P)


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.tiny(mtp=True)
    params = init_params(cfg, seed=2)
    return cfg, params, make(cfg, "bf16", draft_window=K)


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


def test_mtp_extend_and_draft_match_dense(setup):
    cfg, params, steps = setup
    rng = np.random.default_rng(4)
    s = 150
    prompt = rng.integers(0, cfg.vocab_size, (2, s)).astype(np.int32)
    rows = i32([1, 0])
    main_tables = random_tables(rng, C, L, NUM_MAIN_PAGES)
    mtp_tables = random_tables(rng, C, L, NUM_MTP_PAGES)
    main = allocate_planes(steps.config.main_layout, NUM_MAIN_PAGES)
    mtp = allocate_planes(steps.config.mtp_layout, NUM_MTP_PAGES, fill=float("nan"))
    assert steps.config.mtp_layout.num_layers == 1

    # Main prefill chunk by chunk; the MTP pool follows each chunk with (h_i, t_{i+1}) pairs.
    chunk = steps.config.prefill_chunk
    main, out0 = prefill(steps, params, main, main_tables, prompt[:, :chunk], rows)
    nxt = prompt[:, 1 : chunk + 1]
    ext = steps.mtp_extend(params, mtp, jnp.asarray(mtp_tables), out0.hidden, nxt, i32([0, 0]), i32([chunk] * 2), rows)
    mtp = ext.planes
    main, out1 = prefill(steps, params, main, main_tables, prompt[:, chunk:], rows, start=chunk)
    t_s = np.asarray(out1.next_tokens)  # the first generated token, at position s
    tail = s - chunk
    nxt = np.zeros((2, chunk), np.int32)
    nxt[:, : tail - 1] = prompt[:, chunk + 1 :]
    nxt[:, tail - 1] = t_s
    dr = steps.mtp_draft(params, mtp, jnp.asarray(mtp_tables), out1.hidden, nxt, i32([chunk] * 2), i32([tail] * 2), rows)
    drafts = np.asarray(dr.drafts)
    assert drafts.shape == (2, K)

    # Dense: main hidden of the whole prompt, then MTP over (h_i, t_{i+1}), recursively extended.
    # The pair sequence is held at its final length s + K - 1 (causal: trailing pairs are invisible).
    h = dense_forward(params, cfg, prompt, "bf16")
    pairs_h = jnp.concatenate([h, jnp.zeros((2, K - 1, cfg.d_model), h.dtype)], axis=1)
    pairs_t = np.concatenate([prompt[:, 1:], t_s[:, None], np.zeros((2, K - 1), np.int32)], axis=1)
    g, logits = dense_mtp_forward(params, cfg, pairs_h, pairs_t.copy(), "bf16")
    np.testing.assert_allclose(np.asarray(ext.logits), np.asarray(logits[:, chunk - 1]), atol=TOL_BF16, rtol=0)
    np.testing.assert_allclose(np.asarray(ext.hidden), np.asarray(g[:, chunk - 1]), atol=TOL_BF16, rtol=0)
    dense_drafts = []
    for k in range(K):
        i = s - 1 + k  # position of the pair that predicts draft k
        d = np.argmax(np.asarray(logits[:, i]), axis=-1).astype(np.int32)
        np.testing.assert_allclose(np.asarray(dr.draft_logits[:, k]), np.asarray(logits[:, i]), atol=TOL_BF16, rtol=0)
        dense_drafts.append(d)
        if k + 1 < K:
            pairs_h = pairs_h.at[:, i + 1].set(g[:, i])
            pairs_t[:, i + 1] = d
            g, logits = dense_mtp_forward(params, cfg, pairs_h, pairs_t.copy(), "bf16")
    np.testing.assert_array_equal(drafts, np.stack(dense_drafts, 1))

    # The MTP pool holds positions 0 .. s + K - 2 (a lead of K - 1 over Main's s - 1), nothing more.
    k_plane = np.asarray(dr.planes["k"]).astype(np.float32)[0]  # (N, H, P, D)
    last = s + K - 2
    for r in rows:
        pages = mtp_tables[r]
        for pos in (0, s - 1, last):
            assert np.all(np.isfinite(k_plane[pages[pos // 64], :, pos % 64]))
        assert np.all(np.isnan(k_plane[pages[(last + 1) // 64], :, (last + 1) % 64 :]))
        assert np.all(np.isnan(k_plane[pages[3]]))
    unused = np.setdiff1d(np.arange(NUM_MTP_PAGES), mtp_tables[rows].reshape(-1))
    assert np.all(np.isnan(k_plane[unused]))


def test_mtp_padding_rows_write_nothing(setup):
    cfg, params, steps = setup
    rng = np.random.default_rng(9)
    mtp_tables = random_tables(rng, C, L, NUM_MTP_PAGES)
    mtp = allocate_planes(steps.config.mtp_layout, NUM_MTP_PAGES, fill=float("nan"))
    before = {k: _bits(v) for k, v in mtp.items()}
    hidden = jnp.asarray(rng.standard_normal((2, 1, cfg.d_model)), jnp.float32)
    out = steps.mtp_draft(params, mtp, jnp.asarray(mtp_tables), hidden, i32([[3], [4]]), i32([0, 0]), i32([0, 0]), i32([0, 1]))
    for name, plane in out.planes.items():
        np.testing.assert_array_equal(_bits(plane), before[name])
    assert np.all(np.isfinite(np.asarray(out.draft_logits)))
    assert steps.mtp_draft.compiles == steps.mtp_draft.traces


def test_mtp_requires_mtp_params():
    cfg = ModelConfig.tiny()
    with pytest.raises(ValueError, match="mtp=False"):
        cfg.mtp_layout("bf16")
