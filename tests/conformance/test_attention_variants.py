"""Sliding windows, logit soft caps and attention sinks: every backend agrees with the float64
numpy model, rectangular and ragged, and never reads a page wholly before a query block's window.

The pools are the NaN-poisoned pools of :mod:`.cases`; on top of that, every page that lies wholly
before the window of every query of its row is overwritten with poison, so a backend that reads
such a page returns a non-finite result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.schema.profiles import KVProfile

from . import backends, np_ops
from .cases import PAGE, attention_case, attention_geometry, poison_planes
from .checks import assert_attention_close

VARIANTS = {
    "window": dict(window=37),
    "window-pages": dict(window=70),
    "soft-cap": dict(soft_cap=1.5),
    "sinks": dict(sinks=True),
    "all": dict(window=50, soft_cap=1.5, sinks=True),
}
"""The options of each case (``sinks=True``: random logits, one per query head)."""

PROFILES = (KVProfile.K8V4, KVProfile.BF16)


def _sinks(hq: int, seed: int) -> np.ndarray:
    return (2.0 * np.random.default_rng(seed).standard_normal(hq)).astype(np.float32)


def _options(name: str, hq: int, seed: int) -> dict:
    opts = dict(VARIANTS[name])
    if opts.get("sinks"):
        opts["sinks"] = _sinks(hq, seed)
    return opts


def _poison_before_windows(case, positions, window) -> dict:
    """The case's planes with every page wholly before its row's first visible key poisoned."""
    if window is None:
        return case.planes
    lay = case.layout
    fresh = poison_planes({n: x.shape for n, x in case.planes.items()}, {n: x.dtype for n, x in case.planes.items()},
                          np.random.default_rng(0))
    planes = {n: np.array(x, copy=True) for n, x in case.planes.items()}
    for b, row in enumerate(case.table_rows):
        first = int(positions[b]) - window + 1  # the oldest key query 0 of the row may see
        for blk in range(max(first, 0) // PAGE):
            page = int(case.block_tables[row, blk])
            if not 0 <= page < case.num_pages:
                continue
            idx = (case.layer, page) if lay.order.page_axis == 1 else (case.layer, slice(None), page)
            for n in planes:
                planes[n][idx] = fresh[n][idx]
    return planes


def _rows(t: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_lens / positions of 4 rows: a chunk ending mid-page deep in the context, a row with no
    key, queries past a short row's frontier, a chunk ending at capacity."""
    kv_lens = np.array([cap - PAGE - 3, 0, 33, cap])
    positions = np.array([cap - PAGE - 3 - t, 2, 60, cap - t])
    return kv_lens, positions


def _variant_id(param) -> str:
    return param if isinstance(param, str) else param.value


@functools.cache
def _ragged_call(backend: str):
    return jax.jit(lambda *a, sm_scale=None, window=None, soft_cap=None, sinks=None: ops.paged_attention_ragged(
        *a, sm_scale=sm_scale, window=window, soft_cap=soft_cap, sinks=sinks, impl=backend),
        static_argnames=("sm_scale", "window", "soft_cap"))


@pytest.mark.parametrize("profile", PROFILES, ids=_variant_id)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_attention_matches_the_oracle(backend, variant, profile):
    backends.require(backend)
    g = attention_geometry(profile)
    kv_lens, positions = _rows(g.t, g.logical_pages * PAGE)
    case = attention_case(g, kv_lens, seed=11)
    rng = np.random.default_rng(11)
    q = rng.standard_normal((g.batch, g.t, g.heads * g.group, g.head_dim)).astype(np.float32)
    q = (3.0 * q).astype(jnp.dtype(g.q_dtype))  # scores large enough for the soft cap to matter
    opts = _options(variant, g.heads * g.group, seed=11)
    planes = _poison_before_windows(case, positions, opts.get("window"))
    got = backends.paged_attention(backend, q, case.view(planes), case.table_rows, positions, kv_lens, g.sm_scale,
                                   **opts)
    want = np_ops.paged_attention(backends.queries_as_seen(backend, profile, q), case.planes, case.layout, case.layer,
                                  case.block_tables, case.table_rows, positions, kv_lens, g.sm_scale, **opts)
    out = assert_attention_close(got, want, backend=backend, q_dtype=g.q_dtype, what=f"{g} {variant}")
    assert not out[1].any(), "a row with kv_len 0 must return exact zeros, sinks or not"


@pytest.mark.parametrize("variant", ["all"])
def test_ragged_variant_attention_is_each_rows_attention(backend, variant):
    backends.require(backend)
    profile = KVProfile.K8V4
    g = attention_geometry(profile)
    cap = g.logical_pages * PAGE
    kv_lens = np.array([cap - 5, 0, 41, cap])
    lengths = np.array([5, 0, 1, 3])
    positions = kv_lens - lengths
    case = attention_case(g, kv_lens, seed=12)
    starts = (1 + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)
    n = int(starts[-1]) + 2
    q = (3.0 * np.random.default_rng(12).standard_normal((n, g.heads * g.group, g.head_dim))).astype(np.float32)
    q = q.astype(jnp.dtype(g.q_dtype))
    opts = _options(variant, g.heads * g.group, seed=12)
    planes = _poison_before_windows(case, positions, opts.get("window"))
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    got = np.asarray(_ragged_call(backend)(jnp.asarray(q), case.view(planes), i32(case.table_rows), i32(positions),
                                           i32(kv_lens), i32(starts), sm_scale=g.sm_scale, **opts))
    seen = backends.queries_as_seen(backend, profile, q)
    for r, length in enumerate(lengths):
        if not length:
            continue
        rows = slice(int(starts[r]), int(starts[r + 1]))
        want = np_ops.paged_attention(seen[None, rows], case.planes, case.layout, case.layer, case.block_tables,
                                      case.table_rows[r:r + 1], positions[r:r + 1], kv_lens[r:r + 1], g.sm_scale,
                                      **opts)
        assert_attention_close(got[None, rows], want, backend=backend, q_dtype=g.q_dtype, what=f"{g} row {r}")
    assert not np.asarray(got[np.r_[0:1, n - 2:n]], np.float32).any(), "padding tokens must return exact zeros"


def test_bad_options_are_refused_naming_the_value():
    g = attention_geometry(KVProfile.K8V4)
    kv_lens = np.array([10, 0, 5, 7])
    case = attention_case(g, kv_lens, seed=1)
    q = jnp.zeros((g.batch, g.t, g.heads * g.group, g.head_dim), jnp.float32)
    args = (q, case.view(), case.table_rows, np.zeros(4, np.int32), kv_lens)
    for opts, err, match in [
        (dict(window=0), ValueError, r"window=0 .* >= 1"),
        (dict(window=True), TypeError, "window must be None or a Python/numpy int"),
        (dict(window=2.5), TypeError, "window must be None or a Python/numpy int"),
        (dict(soft_cap=0.0), ValueError, r"soft_cap=0.0 .* > 0"),
        (dict(soft_cap=float("inf")), ValueError, "soft_cap=inf"),
        (dict(sinks=np.zeros(3, np.float32)), ValueError, rf"\({g.heads * g.group},\)"),
        (dict(sinks=np.array([np.nan] + [0.0] * (g.heads * g.group - 1), np.float32)), ValueError, r"sinks\[0\]"),
        (dict(sinks=np.zeros(g.heads * g.group, np.int32)), ValueError, "float array"),
    ]:
        with pytest.raises(err, match=match):
            ops.paged_attention(*args, impl="reference", **opts)
