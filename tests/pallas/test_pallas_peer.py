"""Peer check: BF16 head-major decode agrees with JAX's Pallas paged attention (interpret mode).

``jax.experimental.pallas.ops.gpu.paged_attention`` takes one layer's pages ``(H, N, P, D)`` (our
head-major layer slice), a block table per batch row, per-row lengths, and no score scale.  It
multiplies masked-out probabilities (exactly 0) by V, so NaN in unwritten page columns would leak
into its output; the shared inputs here are therefore finite (poison replaced by zeros), and its
table rows are the rows our kernel reads through ``table_rows``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as peer

import pallas_kernels as pk
from ninfer_kv.ops.reference import paged_attention_reference
from tests.conformance.cases import PAGE, make_paged_case


@pytest.mark.slow  # the CPU rehearsal of bench/gpu_check.py compares the peer with ours in the default run
@pytest.mark.parametrize("group,k_splits", [(4, 2)])
def test_bf16_head_major_decode_matches_jax_peer(group, k_splits):
    kv_heads, head_dim = 2, 128
    kv_lens = np.array([100, 64, 200, 1])
    case = make_paged_case("bf16", "head-major", kv_lens=kv_lens, heads=kv_heads, head_dim=head_dim, logical_pages=4,
                           seed=3)
    view = case.view()
    planes = {n: jnp.where(jnp.isnan(p), jnp.zeros((), p.dtype), p) for n, p in view.planes.items()}
    table = np.array(view.block_tables)
    rows = np.asarray(case.table_rows)
    for b, n in enumerate(kv_lens):  # entries past a row's last page -> a valid page (peer tables must be)
        table[rows[b], -(-n // PAGE):] = table[rows[b], 0]
    view = view.replace(planes=planes, block_tables=jnp.asarray(table))
    bsz = len(kv_lens)
    q = (jax.random.normal(jax.random.key(9), (bsz, 1, kv_heads * group, head_dim)) * 0.1).astype(jnp.bfloat16)

    per_row_tables = jnp.asarray(table[rows])  # (B, L): the peer indexes tables by batch row
    width = per_row_tables.shape[1]
    want_peer = peer.paged_attention(
        q[:, 0], planes["k"][case.layer], planes["v"][case.layer], per_row_tables, jnp.asarray(kv_lens, jnp.int32),
        pages_per_compute_block=1, k_splits=k_splits if width % k_splits == 0 else 1, interpret=True,
    )
    args = (q, view, jnp.asarray(case.table_rows), jnp.asarray(kv_lens - 1, jnp.int32), jnp.asarray(kv_lens, jnp.int32))
    cfg = pk.PagedAttentionConfig(k_splits=k_splits)
    got = jax.jit(lambda *a: pk.paged_attention(*a, sm_scale=1.0, config=cfg))(*args)
    ref = jax.jit(lambda *a: paged_attention_reference(*a, sm_scale=1.0))(*args)

    got32 = np.asarray(got[:, 0].astype(jnp.float32))
    peer32 = np.asarray(want_peer.astype(jnp.float32))
    ref32 = np.asarray(ref[:, 0].astype(jnp.float32))
    np.testing.assert_allclose(got32, peer32, atol=2e-2, rtol=2e-2)
    # And both agree with the float32 reference within bf16 output rounding.
    np.testing.assert_allclose(got32, ref32, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(peer32, ref32, atol=2e-2, rtol=2e-2)
