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
