"""cyclic_append and cyclic_attention agree with the numpy model over poisoned ring buffers.

Ring rows are addressed through a permuted ``rows`` vector; slots never written, the ring row no
batch row uses and the other layer are poison.  Appends must store the oracle's codes in slot
``position % slots`` (the later token when a chunk wraps the ring) and change no other bit;
attention must be finite and within :func:`.checks.attention_tolerance` of the model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from . import backends, np_ops
from .cases import PROFILES, CyclicGeometry, attention_geometry, cyclic_geometry, make_cyclic_case, random_kv
from .checks import assert_attention_close, assert_same_planes, raw_bits


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_cyclic_append_steps(backend, profile):
    """Three steps of 11 tokens into rings of 8 slots: a chunk longer than the ring (only its last 8
    tokens survive) beside a short chunk and a row writing nothing, a decode step, a wrapping chunk."""
    g = cyclic_geometry(profile, "append")
    case = make_cyclic_case(g, seed=PROFILES.index(profile), poison="bytes")
    rng = np.random.default_rng(17)
    rows = np.array([2, 0, 1])
    positions = np.array([0, 6, 3])
    for i, valid in enumerate(([11, 3, 0], [1, 1, 1], [0, 3, 7])):
        k, v = random_kv(rng, (3, 11, g.heads, g.head_dim), spread=True)
        got = backends.cyclic_append(backend, case.view(), rows, positions, k, v, valid)
        want = np_ops.cyclic_append(case.planes, case.layout, case.layer, rows, positions, k, v, valid)
        assert_same_planes(got, want, f"{backend} {profile.value} step {i}")
        assert any((raw_bits(want[n]) != raw_bits(case.planes[n])).any() for n in want), "the step wrote nothing"
        case.planes = got
        positions = positions + np.asarray(valid)


def _attention(backend: str, g: CyclicGeometry, q_dtype: str, sm_scale, t: int, group: int, seed: int) -> None:
    """Batch rows read ring rows (2, 0, 1) holding 55 (wrapped), 8 and 25 (wrapped mid-window)
    positions; queries end at each row's last position except the young row's, which start at 3."""
    written = np.array([8, 25, 55])
    case = make_cyclic_case(g, written=written, seed=seed)
    rows = np.array([2, 0, 1])
    kv_lens = written[rows]
    positions = kv_lens - t
    positions[1] = 3
    q = np.random.default_rng(seed).standard_normal((3, t, g.heads * group, g.head_dim)).astype(np.float32)
    q = q.astype(jnp.dtype(q_dtype))
    got = backends.cyclic_attention(backend, q, case.view(), rows, positions, kv_lens, sm_scale)
    want = np_ops.cyclic_attention(backends.queries_as_seen(backend, case.layout.profile, q), case.planes, case.layout, case.layer, rows, positions, kv_lens, sm_scale)
    assert_attention_close(got, want, backend=backend, q_dtype=q_dtype, what=f"cyclic {g}")


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
def test_cyclic_attention_matches_the_oracle(backend, profile):
    """A window of 20 in 24 slots, 5 queries per row, GQA 4; query dtype and sm_scale as the
    profile's paged-attention geometry."""
    p = attention_geometry(profile)
    _attention(backend, cyclic_geometry(profile, "attention"), p.q_dtype, p.sm_scale, t=5, group=4,
               seed=PROFILES.index(profile))


_RINGS = [  # (window, slots, T, group): a ring just big enough for the chunk, a decode ring, window == slots
    (40, 44, 5, 2),
    (40, 40, 1, 8),
    (16, 16, 1, 1),
    (24, 26, 3, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.value)
@pytest.mark.parametrize("window,slots,t,group", _RINGS)
def test_cyclic_attention_rings(backend, profile, window, slots, t, group):
    """Wide sweep: other windows, ring sizes, query lengths and GQA groups."""
    g = CyclicGeometry(profile, cyclic_geometry(profile, "attention").head_dim, window, slots)
    _attention(backend, g, "float32", None, t=t, group=group, seed=window + t)
