"""A sequence's logits do not depend on the batch around it (the FFI row kernel's products)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.models.decoder import ModelConfig, StepConfig, init_params, make_steps
from ninfer_kv.models.decoder.layers import Products, matmul_t, products
from ninfer_kv.ops import available_impls
from ninfer_kv.ops.views import allocate_planes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from model_harness import greedy_decode, prefill  # noqa: E402


def _ffi() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return "ffi" in available_impls()


pytestmark = pytest.mark.skipif(not _ffi(), reason="the FFI library is not available here")

_CFG = ModelConfig.tiny(dtype="bfloat16", vocab_size=320, d_model=160, mlp_dim=352)  # K % 32 != 0 tails too


def _row0_logits(steps, params, batch: int, length: int) -> np.ndarray:
    """Row 0's first-token and 3 decode logits, the prompt of row 0 fixed and other rows random."""
    rng = np.random.default_rng(batch)
    prompt = rng.integers(0, _CFG.vocab_size, (batch, length)).astype(np.int32)
    prompt[0] = np.random.default_rng(0).integers(0, _CFG.vocab_size, length)
    blocks = -(-(length + 3) // 64)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)[rng.permutation(batch)]
    planes = allocate_planes(steps.config.main_layout, batch * blocks + 1)
    rows = list(range(batch))
    planes, first = prefill(steps, params, planes, tables, prompt, rows)
    planes, _, logits, _ = greedy_decode(steps, params, planes, tables, first.next_tokens, length, rows, 3)
    return np.concatenate([np.asarray(first.logits)[:1], logits[0]], 0)


_CASES = [(mode, packed, batches, length) for mode, packed in (("batch_invariant", False), ("auto", True))
          for batches, length in (((1, 2, 4), 70), ((1, 8, 16), 70), ((1, 16), 600))]
# By default: the batch-invariant products over 600 tokens (batch 1 splits the context, 16 not) and the
# packed weights at 70 tokens in batches 1, 8 and 16; the other cases under -m slow.
_DEFAULT = {("batch_invariant", (1, 16)), ("auto", (1, 8, 16))}


@pytest.mark.parametrize("mode, packed, batches, length", [
    pytest.param(*c, id=f"{'auto-packed-weights' if c[1] else c[0]}-{c[3]}-{'x'.join(map(str, c[2]))}",
                 marks=() if (c[0], c[2]) in _DEFAULT else pytest.mark.slow) for c in _CASES])
def test_a_rows_logits_are_bit_identical_whatever_the_batch(mode, packed, batches, length):
    """600 tokens: at batch 1 the FFI attention would split the context over threads, at 16 not.
    The default products over packed weights (what the engine and the generator run) are invariant."""
    steps = make_steps(StepConfig(model=_CFG, impl="ffi", products=mode, batch_buckets=(1, 2, 4, 8, 16)))
    params = init_params(_CFG, seed=3)
    if packed:
        params = steps.prepare_params(params)
    first = _row0_logits(steps, params, batches[0], length)
    assert np.isfinite(first).all()
    for b in batches[1:]:
        np.testing.assert_array_equal(_row0_logits(steps, params, b, length), first, err_msg=f"batch {b}")


def test_the_row_kernel_matches_float32_products_and_ignores_other_rows():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((19, 200)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((37, 200)), jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    with products(Products.BATCH_INVARIANT):
        got = np.asarray(matmul_t(x, w))
        one = np.asarray(matmul_t(x[5:6], w))
        shaped = np.asarray(matmul_t(x.reshape(1, 19, 200), w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(one[0], got[5])
    np.testing.assert_array_equal(shaped[0], got)


def test_bad_products_and_operands_are_refused():
    from ninfer_kv.ops.ffi import products as ffi_products

    with pytest.raises(ValueError, match="products='exact' is not supported; allowed: auto, xla, batch_invariant"):
        StepConfig(model=_CFG, products="exact")
    with pytest.raises(ValueError, match="x must be bfloat16"):
        ffi_products.matmul_bf16(jnp.zeros((2, 64)), jnp.zeros((3, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"are not \(\.\.\., K\) and \(N, K\)"):
        ffi_products.matmul_bf16(jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((3, 32), jnp.bfloat16))


def test_fixed_splits_make_a_rows_attention_independent_of_the_batch():
    """At batch 1 the FFI attention splits a long row's context over the threads, at batch 8 not: the
    outputs differ in the last bits, unless ``fixed_splits`` (what the batch-invariant steps trace)."""
    from ninfer_kv.ops.ffi import kv as ffi_kv
    from ninfer_kv.ops.ffi import handlers as ffi_handlers
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import PagedKVBatchLayerView

    if ffi_handlers.num_threads() < 2:
        pytest.skip("one FFI thread: the attention never splits")
    lay = PagedKVStorageLayout("bf16", 1, 2, 64)
    blocks = 40
    rng = np.random.default_rng(5)
    planes = {name: jnp.asarray(rng.standard_normal(shape), dtype)
              for (name, shape), dtype in zip(lay.plane_shapes(8 * blocks).items(), lay.plane_dtypes().values())}
    tables = jnp.asarray(rng.permutation(8 * blocks).reshape(8, blocks).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((8, 1, 4, 64)), jnp.float32)
    lens = jnp.asarray([blocks * 64] + [100] * 7, jnp.int32)
    rows = jnp.arange(8, dtype=jnp.int32)

    def row0(batch):
        view = PagedKVBatchLayerView(planes, tables[:batch], 0, lay)
        traced_here = jax.jit(lambda *a: ffi_kv.paged_attention(*a))  # a fresh trace: the context is read then
        return np.asarray(traced_here(q[:batch], view, rows[:batch], lens[:batch] - 1, lens[:batch]))[0]

    assert not np.array_equal(row0(1), row0(8))  # the control: adaptive splits move the last bits
    with ffi_handlers.fixed_splits():
        np.testing.assert_array_equal(row0(1), row0(8))


def test_auto_takes_the_row_kernel_for_one_row_only():
    from ninfer_kv.ops.ffi import products as ffi_products

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 96)), jnp.bfloat16)
    with products(Products.AUTO):
        one, three = np.asarray(matmul_t(x[:1], w)), np.asarray(matmul_t(x, w))
    np.testing.assert_array_equal(one, np.asarray(ffi_products.matmul_bf16(x[:1], w)))
    with products(Products.XLA):
        np.testing.assert_array_equal(three, np.asarray(matmul_t(x, w)))


def test_several_weights_in_one_call_equal_one_call_each():
    from ninfer_kv.ops.ffi import products as ffi_products

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((5, 1, 96)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((n, 96)), jnp.bfloat16) for n in (40, 8, 700)]
    many = ffi_products.matmul_bf16_many(x, ws)
    for w, got in zip(ws, many):
        assert got.shape == (5, 1, w.shape[0])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ffi_products.matmul_bf16(x, w)))
    with pytest.raises(ValueError, match=r"x \(5, 1, 96\) and w\[1\] \(8, 95\)"):
        ffi_products.matmul_bf16_many(x, [ws[0], jnp.zeros((8, 95), jnp.bfloat16)])
    with pytest.raises(ValueError, match="at least one weight"):
        ffi_products.matmul_bf16_many(x, [])
