"""The decoder's elementwise layers round where torch rounds, element for element."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ninfer_kv.models.decoder.layers import silu  # noqa: E402


def test_silu_equals_torchs_bfloat16_silu_on_every_element():
    x = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    x[:4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    want = torch.nn.functional.silu(x).view(torch.int16).numpy()
    xj = jnp.asarray(x.view(torch.int16).numpy()).view(jnp.bfloat16)
    got = np.asarray(jax.jit(silu)(xj)).view(np.int16)
    np.testing.assert_array_equal(got, want)
    assert (np.asarray(jax.jit(jax.nn.silu)(xj)).view(np.int16) != want).mean() > 0.2  # what it replaces


def test_gelu_tanh_equals_torchs_bfloat16_gelu_tanh_on_every_bfloat16():
    from ninfer_kv.models.decoder.layers import gelu_tanh

    bits = np.arange(-(1 << 15), 1 << 15, dtype=np.int16)  # every bfloat16 value
    x = torch.from_numpy(bits.copy()).view(torch.bfloat16)
    want = torch.nn.functional.gelu(x, approximate="tanh")
    got = np.asarray(jax.jit(gelu_tanh)(jnp.asarray(bits).view(jnp.bfloat16))).view(np.int16)
    # XLA's CPU backend flushes subnormal float32 results to zero; torch keeps them (and may round one up to
    # the smallest normal): results within ~1e-38 of zero, of inputs within ~2e-38 of zero
    normal = torch.isfinite(want) & ((want.float().abs() > torch.finfo(torch.float32).tiny) | (want == 0))
    np.testing.assert_array_equal(got[normal.numpy()], want.view(torch.int16).numpy()[normal.numpy()])
    assert normal.sum() > 64000
    plain = np.asarray(jax.jit(lambda v: jax.nn.gelu(v, approximate=True))(jnp.asarray(bits).view(jnp.bfloat16)))
    # what it replaces: 1.5% of all bfloat16 values (most are so large or small that GELU is x or 0)
    assert (plain.view(np.int16) != want.view(torch.int16).numpy())[normal.numpy()].mean() > 0.01


def test_gelu_tanh_float32_is_within_a_few_steps_of_torchs():
    from ninfer_kv.models.decoder.layers import gelu_tanh

    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) * 4
    want = torch.nn.functional.gelu(x, approximate="tanh").numpy()
    got = np.asarray(jax.jit(gelu_tanh)(jnp.asarray(x.numpy())))
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7)


def test_gemma_rms_norm_equals_transformers_cast_order():
    transformers = pytest.importorskip("transformers")
    from ninfer_kv.models.decoder.layers import rms_norm

    gen = torch.Generator().manual_seed(2)
    norm = transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen) * 0.5)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(64, 256, generator=gen) * 3).to(dtype)
        w = norm.weight.detach().to(dtype)
        with torch.no_grad():
            want = norm.to(dtype)(x).float().numpy()
        got = np.asarray(rms_norm(jnp.asarray(x.float().numpy()).astype(jnp.dtype(str(dtype)[6:])),
                                  jnp.asarray(w.float().numpy()).astype(jnp.dtype(str(dtype)[6:])), 1e-6, offset=True))
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
        # the (1 + w) product taken in the activation dtype (Llama's order) differs
        if dtype == torch.bfloat16:
            llama = np.asarray(rms_norm(jnp.asarray(x.float().numpy()).astype(jnp.bfloat16),
                                        1 + jnp.asarray(w.float().numpy()).astype(jnp.bfloat16), 1e-6))
            assert (llama.astype(np.float32) != want).mean() > 0.1


def test_gemma_embedding_normalizer_rounds_as_transformers():
    from ninfer_kv.models.decoder import ModelConfig
    from ninfer_kv.models.decoder.model import embed_tokens

    d = 3072  # sqrt(3072) = 55.4256 is 55.5 in bfloat16 (transformers' comment on Gemma)
    emb = torch.randn(8, d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = (emb * torch.tensor(d**0.5).to(torch.bfloat16)).float().numpy()
    config = ModelConfig.tiny(d_model=d, vocab_size=8, embed_scale=True, dtype="bfloat16")
    got = embed_tokens({"embed": jnp.asarray(emb.float().numpy()).astype(jnp.bfloat16)}, jnp.arange(8)[None], config)
    np.testing.assert_array_equal(np.asarray(got[0]).astype(np.float32), want)
