"""The ragged step: a ragged round (decodes beside a prefill chunk) is the rectangular steps, row by row.

With batch-invariant products on the FFI every row's logits and every stored KV byte are the same
bits as the decode step gives the decode rows and the prefill step gives the chunk; on the
reference backend (float32 model) they agree within float32 rounding.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.models.decoder import ModelConfig, StepConfig, init_params, make_steps
from ninfer_kv.models.decoder.padding import pad_ragged
from ninfer_kv.ops import available_impls
from ninfer_kv.ops.views import allocate_planes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from model_harness import copy_planes, i32, prefill, random_tables  # noqa: E402


def _ffi() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return "ffi" in available_impls()


_BF16 = ModelConfig.tiny(dtype="bfloat16", vocab_size=320, d_model=160, mlp_dim=352)
_F32 = ModelConfig.tiny(vocab_size=320)
# Gemma's options with a 24-token window on the first layer (shorter than the 40-token chunk and the 70-token prompts)
_WINDOWED = ModelConfig.tiny(dtype="bfloat16", vocab_size=320, qk_norm=True, layer_types=("sliding_attention", "full_attention"),
                             sliding_window=24, attn_soft_cap=20.0, final_soft_cap=15.0, query_scale=0.1, gemma_norms=True,
                             sandwich_norms=True, mlp_activation="gelu_tanh", embed_scale=True, local_rope_theta=1000.0,
                             window_rings=False)  # these steps take the Main pool alone (the rings need a state)
_CASES = [
    pytest.param(_BF16, "ffi", "batch_invariant", id="ffi-bf16-batch-invariant",
                 marks=pytest.mark.skipif(not _ffi(), reason="the FFI library is not available here")),
    pytest.param(_WINDOWED, "ffi", "batch_invariant", id="ffi-bf16-windowed-gemma",
                 marks=pytest.mark.skipif(not _ffi(), reason="the FFI library is not available here")),
    pytest.param(_F32, "reference", "auto", id="reference-f32"),
]


def _compare(got, want, exact: bool, what: str, rtol: float = 2e-5) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=2e-5, err_msg=what)


@pytest.mark.parametrize("cfg, impl, mode", _CASES)
def test_a_ragged_round_is_the_decode_and_prefill_steps(cfg, impl, mode):
    exact = impl == "ffi"
    steps = make_steps(StepConfig(model=cfg, impl=impl, products=mode, prefill_chunk=64,
                                  batch_buckets=(1, 2, 4), token_buckets=(16, 64)))
    params = init_params(cfg, seed=5)
    rng = np.random.default_rng(5)
    blocks = 3
    tables = random_tables(rng, 4, blocks, 4 * blocks + 2)
    planes = allocate_planes(steps.config.main_layout, 4 * blocks + 2)
    # rows 2 and 0 hold 70-token prompts; row 3 starts a 40-token prompt in the ragged round
    prompt = rng.integers(0, cfg.vocab_size, (2, 70)).astype(np.int32)
    planes, first = prefill(steps, params, planes, tables, prompt, [2, 0])
    chunk = rng.integers(0, cfg.vocab_size, 40).astype(np.int32)
    nxt = np.asarray(first.next_tokens)[:2].astype(np.int32)
    base = copy_planes(planes)

    # rectangular: one decode step for rows 2 and 0, one prefill step for row 3's chunk
    dec = steps.decode(params, copy_planes(base), jnp.asarray(tables), nxt[:, None], i32([70, 70]), i32([1, 1]),
                       i32([2, 0]))
    tok = np.zeros((1, 64), np.int32)
    tok[0, :40] = chunk
    pre = steps.prefill(params, dec.planes, jnp.asarray(tables), tok, i32([0]), i32([40]), i32([3]))

    # ragged: the three rows in one call (a bucket of 4 rows and 64 tokens: one padding row)
    p = pad_ragged(np.concatenate([nxt, chunk]), [1, 1, 40], [70, 70, 0], [2, 0, 3], bucket=4, token_bucket=64)
    out = steps.ragged(params, copy_planes(base), jnp.asarray(tables), p.tokens, p.positions, p.query_starts,
                       p.table_rows)
    logits = np.asarray(out.logits)
    assert logits.shape == (4, cfg.vocab_size) and np.isfinite(logits).all()
    _compare(logits[:2], dec.logits[:2], exact, "decode rows")
    _compare(logits[2], pre.logits[0], exact, "prefill row")
    np.testing.assert_array_equal(np.asarray(out.next_tokens)[:2], np.asarray(dec.next_tokens)[:2])
    assert int(out.next_tokens[2]) == int(pre.next_tokens[0])
    for name in pre.planes:
        # bfloat16 planes: float32 rounding differences of the reference's products may move one ulp
        _compare(out.planes[name], pre.planes[name], exact, f"plane {name}", rtol=2.0**-7)
    assert steps.ragged.compiles == 1


def test_the_ragged_step_refuses_shapes_off_its_buckets():
    steps = make_steps(StepConfig(model=_F32, impl="reference", batch_buckets=(1, 2), token_buckets=(16,)))
    params = init_params(_F32, seed=1)
    planes = allocate_planes(steps.config.main_layout, 4)
    tables = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"ragged: 17 tokens is not a token bucket \(16,\); pad with"):
        steps.ragged(params, planes, tables, i32(np.zeros(17)), i32([0]), i32([0, 1]), i32([0]))
    with pytest.raises(ValueError, match=r"ragged: batch size 3 is not a bucket \(1, 2\)"):
        steps.ragged(params, planes, tables, i32(np.zeros(16)), i32([0] * 3), i32([0] * 4), i32([0] * 3))
    with pytest.raises(ValueError, match=r"ragged: query_starts must be int32 \(3,\)"):
        steps.ragged(params, planes, tables, i32(np.zeros(16)), i32([0, 0]), i32([0, 1]), i32([0, 0]))
    with pytest.raises(ValueError, match="lengths must be >= 0 and sum to the 3 tokens"):
        pad_ragged(np.zeros(3, np.int32), [1, 1], [0, 0], [0, 1], bucket=2, token_bucket=16)
    with pytest.raises(ValueError, match="token_bucket=2 must be an integer >= the 3 tokens"):
        pad_ragged(np.zeros(3, np.int32), [1, 2], [0, 0], [0, 1], bucket=2, token_bucket=2)
