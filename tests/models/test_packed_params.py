"""Packed projection weights in the decoder (weights.pack_params, layers.matmul_t on PackedWeight)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.ops.ffi import products as ffi_products

from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.models.decoder import ModelConfig, init_params, pack_params
from ninfer_kv.models.decoder.layers import matmul_t, matmul_t_many, products
from ninfer_kv.models.decoder.weights import PROJECTIONS
from ninfer_kv.ops.ffi.packed_weight import PackedWeight, unpack_bf16_weight

CFG = ModelConfig(vocab_size=300, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96,
                  rope_theta=1e6, rms_eps=1e-6, dtype="bfloat16", qk_norm=True, tie_embeddings=True)


def test_pack_params_packs_projections_and_a_tied_head():
    params = init_params(CFG, 0)
    packed = pack_params(params, CFG)
    for lp, plain in zip(packed["layers"], params["layers"]):
        for name, value in lp.items():
            if name in PROJECTIONS:
                assert isinstance(value, PackedWeight)
                np.testing.assert_array_equal(np.asarray(unpack_bf16_weight(value), np.float32),
                                              np.asarray(plain[name], np.float32))
            else:
                assert value is plain[name]
    assert packed["embed"] is params["embed"] and isinstance(packed["lm_head"], PackedWeight)
    assert packed["lm_head"].shape == params["embed"].shape
    f32 = dataclasses.replace(CFG, dtype="float32")
    leaves = jax.tree_util.tree_leaves(pack_params(init_params(f32, 0), f32), is_leaf=lambda v: isinstance(v, PackedWeight))
    assert not any(isinstance(v, PackedWeight) for v in leaves)


@pytest.mark.skipif(not ffi_handlers.is_available(), reason="FFI library unavailable")
def test_matmul_t_on_packed_weights_per_mode():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((90, 64)) * 0.1, jnp.bfloat16)
    pw = pack_params({"layers": ({"wq": w},), "embed": w, "lm_head": w}, CFG)["layers"][0]["wq"]
    want = np.asarray(ffi_products.matmul_bf16_packed(x, pw))
    for mode in ("auto", "batch_invariant"):
        with products(mode):
            np.testing.assert_array_equal(np.asarray(jax.jit(matmul_t)(x, pw)), want)
            got = jax.jit(matmul_t_many)(x, (pw, pw))
            np.testing.assert_array_equal(np.asarray(got[1]), want)
            # one row alone: the same bits as inside the batch
            np.testing.assert_array_equal(np.asarray(jax.jit(matmul_t)(x[2:3], pw))[0], want[2])
    with products("xla"):
        np.testing.assert_allclose(np.asarray(jax.jit(matmul_t)(x, pw)), want, rtol=1e-5, atol=1e-5)
