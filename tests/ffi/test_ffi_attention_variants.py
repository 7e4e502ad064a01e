"""Sliding windows, logit soft caps and attention sinks in the FFI paged attention kernels.

* every option against ``ninfer_kv.ops.reference`` (bf16 and k8v4 pools with pages in random order
  and NaN-poisoned unused pages, both plane orders, GQA groups 1 and 4, decode and a chunk of more
  than a page of queries, windows shorter than, equal to and longer than a page or the context);
* pages wholly before every query's window are never read: they are poisoned with NaN and the
  output stays finite and equal to the reference on the clean pool (with context splits too);
* the integer scores of NVFP4 keys (the ``avx512vnni`` level) take the same cap, window and sinks;
* every compiled level this CPU runs agrees with the reference (each forced in a subprocess);
* with every option off the ops make the call they always made: a window longer than the
  context and no cap or sinks (the variant handler) gives the plain handler's output bit for bit,
  and, when ``NINFER_KV_FFI_OLD_LIBRARY`` names a library built before the options, the plain
  ops give that library's output bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv.ops import reference
from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.ops.ffi import kv as ffi_kv
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.schema.profiles import KVProfile

from tests.conformance.cases import PAGE, make_paged_case, plane_index
from tests.conformance.checks import assert_attention_close

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason="the FFI library is unavailable")

REPO = Path(__file__).resolve().parents[2]
D = 64
HEADS = 2


def _case(profile, order, kv_lens, *, logical_pages=4, seed=0):
    return make_paged_case(profile, order, kv_lens=kv_lens, heads=HEADS, head_dim=D, logical_pages=logical_pages,
                           seed=seed)


def _inputs(case, group, t, *, q_scale=4.0, q_dtype=jnp.float32, seed=1):
    """Queries large enough for a soft cap to matter; positions so that the last query is the last key."""
    rng = np.random.default_rng(seed)
    b = case.kv_lens.size
    q = (q_scale * rng.standard_normal((b, t, HEADS * group, D))).astype(np.float32)
    positions = np.maximum(case.kv_lens - t, 0).astype(np.int32)
    sinks = rng.standard_normal(HEADS * group).astype(np.float32)
    return jnp.asarray(q, q_dtype), positions, sinks


def _run(case, q, positions, view=None, **opts):
    view = case.view() if view is None else view
    return ffi_kv.paged_attention(q, view, case.table_rows, positions, case.kv_lens, **opts)


def _want(case, q, positions, **opts):
    return np.asarray(reference.paged_attention_reference(
        jnp.asarray(q, jnp.float32), case.view(), case.table_rows, positions, case.kv_lens, **opts), np.float32)


OPTIONS = [
    dict(window=16),
    dict(window=PAGE),
    dict(window=PAGE + 7),
    dict(window=10_000),
    dict(soft_cap=5.0),
    dict(soft_cap=50.0),
    dict(sinks=True),
    dict(window=40, soft_cap=8.0, sinks=True),
]


def _opts(case_opts, sinks):
    o = dict(case_opts)
    if o.get("sinks"):
        o["sinks"] = jnp.asarray(sinks)
    return o


@pytest.mark.slow  # by default: tests/conformance/test_attention_variants.py, every option on both profiles
@pytest.mark.parametrize("profile", [KVProfile.BF16, KVProfile.K8V4], ids=lambda p: p.value)
@pytest.mark.parametrize("order", list(PlaneOrder), ids=lambda o: o.name.lower())
@pytest.mark.parametrize("group,t", [(1, 1), (4, 1), (4, 70), (1, 70)])
def test_options_match_the_reference(profile, order, group, t):
    case = _case(profile, order, [200, 256, 75, 3 if t == 1 else 70])
    q, positions, sinks = _inputs(case, group, t)
    for i, o in enumerate(OPTIONS):
        if (group, t, order) != (4, 70, PlaneOrder.PAGE_MAJOR) and i % 2 == (t == 1):  # halve the cross product
            continue
        opts = _opts(o, sinks)
        got = _run(case, q, positions, **opts)
        assert_attention_close(got, _want(case, q, positions, **opts), backend="ffi", q_dtype=q.dtype, what=str(o))


@pytest.mark.slow  # by default: the conformance suite's ragged case with every option (tests/conformance)
@pytest.mark.parametrize("profile", [KVProfile.BF16, KVProfile.K8V4], ids=lambda p: p.value)
def test_bfloat16_queries_and_ragged_rows(profile):
    case = _case(profile, PlaneOrder.HEAD_MAJOR, [130, 256, 66])
    rng = np.random.default_rng(3)
    lens = [5, 1, 66]  # query tokens per row
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = (case.kv_lens - np.asarray(lens)).astype(np.int32)
    q = jnp.asarray(4.0 * rng.standard_normal((int(starts[-1]), HEADS * 4, D)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(HEADS * 4), jnp.float32)
    for opts in (dict(window=33, soft_cap=6.0, sinks=sinks), dict(window=PAGE), dict(sinks=sinks)):
        got = ffi_kv.paged_attention_ragged(q, case.view(), case.table_rows, positions, case.kv_lens, starts, **opts)
        want = reference.paged_attention_ragged_reference(q.astype(jnp.float32), case.view(), case.table_rows,
                                                          positions, case.kv_lens, starts, **opts)
        assert_attention_close(got, np.asarray(want, np.float32), backend="ffi", q_dtype=q.dtype, what=str(opts))


def _poison_before_windows(case, positions, window) -> dict:
    """The planes with every page wholly before the earliest query's window of its row set to NaN
    (NaN codes or NaN scales, so that reading any of them makes the output NaN)."""
    planes = {k: v.copy() for k, v in case.planes.items()}
    poisoned = 0
    for b in range(case.kv_lens.size):
        first = max(0, int(positions[b]) - window + 1)
        for blk in range(first // PAGE):
            page = int(case.block_tables[case.table_rows[b], blk])
            idx = plane_index(case.layout.order, case.layer, page, slice(None))
            for name, arr in planes.items():
                if arr.dtype.kind == "u" and name.endswith("_scale"):
                    arr[idx] = 0x7F  # NaN as e4m3fn
                elif arr.dtype.kind not in "iu":
                    arr[idx] = np.nan
            poisoned += 1
    assert poisoned > 0
    return planes


@pytest.mark.parametrize("profile", [KVProfile.BF16, KVProfile.K8V4], ids=lambda p: p.value)
@pytest.mark.parametrize("group,t", [(4, 1), (1, 70)])
def test_pages_before_the_window_are_not_read(profile, group, t):
    case = _case(profile, PlaneOrder.PAGE_MAJOR, [256, 200, 190], logical_pages=4)
    q, positions, sinks = _inputs(case, group, t)
    for window in (1, 20, PAGE, 100):
        opts = dict(window=window, soft_cap=20.0, sinks=jnp.asarray(sinks))
        view = case.view(planes=_poison_before_windows(case, positions, window))
        got = _run(case, q, positions, view=view, **opts)
        assert_attention_close(got, _want(case, q, positions, **opts), backend="ffi", q_dtype=q.dtype,
                               what=f"window={window}")


@pytest.mark.parametrize("no_splits", [False, True])
def test_context_splits_cover_only_the_window(no_splits):
    """One long decode row over one KV head: the kernel splits its context over the pool (the sink
    must count once); the pages before the window are poisoned."""
    case = make_paged_case(KVProfile.BF16, PlaneOrder.HEAD_MAJOR, kv_lens=[1500], heads=1, head_dim=D,
                           logical_pages=24, seed=5)
    rng = np.random.default_rng(6)
    q = jnp.asarray(3.0 * rng.standard_normal((1, 1, 4, D)), jnp.float32)
    positions = np.array([1499], np.int32)
    sinks = jnp.asarray(rng.standard_normal(4) + 2.0, jnp.float32)
    view = case.view(planes=_poison_before_windows(case, positions, 900))
    for opts in (dict(window=900, sinks=sinks), dict(window=900, soft_cap=10.0), dict(window=900)):
        with ffi_handlers.fixed_splits() if no_splits else contextlib.nullcontext():
            got = ffi_kv.paged_attention(q, view, case.table_rows, positions, case.kv_lens, **opts)
        want = reference.paged_attention_reference(q, case.view(), case.table_rows, positions, case.kv_lens, **opts)
        assert_attention_close(got, np.asarray(want), backend="ffi", q_dtype=q.dtype, what=str(opts))


def test_integer_scores_take_the_options():
    """NVFP4 keys: int8x2 scores at the VNNI level (float32 elsewhere), held to the int8x2 bound of
    tests/ffi/test_ffi_arithmetic.py (relative L2), and visibly changed by each option."""
    case = _case(KVProfile.NVFP4_G16, PlaneOrder.PAGE_MAJOR, [256, 130, 64])
    q, positions, sinks = _inputs(case, 4, 3)
    plain = np.asarray(_want(case, q, positions))
    for opts in (dict(soft_cap=4.0), dict(window=30), dict(sinks=jnp.asarray(sinks + 15.0)),
                 dict(window=PAGE, soft_cap=6.0, sinks=jnp.asarray(sinks))):
        got = np.asarray(_run(case, q, positions, **opts), np.float32)
        want = _want(case, q, positions, **opts)
        assert np.isfinite(got).all()
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= 2e-4, (opts, rel, ffi_handlers.arithmetic(KVProfile.NVFP4_G16, D))
        assert np.linalg.norm(want - plain) / np.linalg.norm(plain) > 1e-2, opts  # the option mattered


def test_options_off_take_the_plain_path_bit_for_bit():
    """The variant handler with a window past the context, no cap and no sinks equals the plain one."""
    for profile in (KVProfile.BF16, KVProfile.K8V4, KVProfile.NVFP4_G16):
        case = _case(profile, PlaneOrder.HEAD_MAJOR, [200, 256, 75, 70])
        q, positions, _ = _inputs(case, 4, 70)
        plain = np.asarray(_run(case, q, positions))
        wide = np.asarray(_run(case, q, positions, window=1 << 20))
        assert plain.tobytes() == wide.tobytes(), profile


def test_option_checks():
    case = _case(KVProfile.BF16, PlaneOrder.PAGE_MAJOR, [10])
    q, positions, _ = _inputs(case, 1, 1)
    with pytest.raises(ValueError, match="window"):
        _run(case, q, positions, window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        _run(case, q, positions, soft_cap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        _run(case, q, positions, sinks=jnp.zeros(3, jnp.float32))


def test_no_visible_key_returns_zeros_with_a_sink():
    case = _case(KVProfile.BF16, PlaneOrder.PAGE_MAJOR, [0, 50])
    q, _, sinks = _inputs(case, 2, 1)
    got = np.asarray(_run(case, q, np.array([0, 49], np.int32), sinks=jnp.asarray(sinks), window=5))
    assert (got[0] == 0).all() and np.isfinite(got).all()


# -- every level, each forced in a subprocess -------------------------------------------------------

_LEVEL_SCRIPT = r"""
import json, sys
import jax.numpy as jnp, numpy as np
sys.path.insert(0, {repo!r})
from tests.ffi import test_ffi_attention_variants as t
from ninfer_kv.ops.ffi import handlers
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.schema.profiles import KVProfile
errors = []
for profile in (KVProfile.BF16, KVProfile.K8V4, KVProfile.NVFP4_G16):
    case = t._case(profile, PlaneOrder.HEAD_MAJOR, [200, 256, 75, 70])
    q, positions, sinks = t._inputs(case, 4, 70)
    for opts in (dict(window=40, soft_cap=8.0, sinks=jnp.asarray(sinks)), dict(window=t.PAGE), dict(soft_cap=5.0)):
        got = np.asarray(t._run(case, q, positions, **opts), np.float32)
        want = t._want(case, q, positions, **opts)
        if profile is KVProfile.NVFP4_G16:
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want)); ok = err <= 2e-4
        else:
            err = float(np.max(np.abs(got - want) / (2e-5 + 2e-5 * np.abs(want)))); ok = err <= 1.0
        if not (ok and np.isfinite(got).all()):
            errors.append([profile.value, str(sorted(opts)), err])
print(json.dumps(dict(isa=handlers.info().isa, errors=errors)))
"""


@pytest.mark.slow  # a process per level; the default run checks the level in use (and its int8x2 scores above)
def test_every_level_agrees_with_the_reference():
    levels = ffi_handlers.info().supported
    procs = {}
    for level in levels:
        env = dict(os.environ, NINFER_KV_FFI_ISA=level, NINFER_KV_FFI_THREADS="2")
        procs[level] = subprocess.Popen([sys.executable, "-c", _LEVEL_SCRIPT.format(repo=str(REPO))], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    for level, p in procs.items():
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        res = json.loads(out.strip().splitlines()[-1])
        assert res["isa"] == level
        assert res["errors"] == [], (level, res["errors"])


# -- the previous library ---------------------------------------------------------------------------

_OLD_SCRIPT = r"""
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from tests.ffi import test_ffi_attention_variants as t
np.savez({out!r}, **t._plain_outputs())
"""


def _plain_outputs() -> dict:
    """Outputs of the plain ops (every option off) over a spread of pools, queries and shapes."""
    out = {}
    for profile in (KVProfile.BF16, KVProfile.K8V4, KVProfile.NVFP4_G16, KVProfile.INT8_G64):
        for order in PlaneOrder:
            case = _case(profile, order, [200, 256, 75, 70])
            for group, t, dt in ((1, 1, jnp.float32), (4, 70, jnp.bfloat16), (4, 3, jnp.float32)):
                q, positions, _ = _inputs(case, group, t, q_dtype=dt)
                key = f"{profile.value}-{order.name}-{group}-{t}"
                out[key] = np.asarray(_run(case, q, positions).astype(jnp.float32))
            starts = np.array([0, 3, 4, 70], np.int32)
            qr = jnp.asarray(np.random.default_rng(9).standard_normal((70, HEADS * 2, D)), jnp.float32)
            pos = np.array([190, 255, 10, 0], np.int32)[:3]
            out[f"{profile.value}-{order.name}-ragged"] = np.asarray(ffi_kv.paged_attention_ragged(
                qr, case.view(), case.table_rows[:3], pos, case.kv_lens[:3], starts))
    return out


@pytest.mark.skipif(not os.environ.get("NINFER_KV_FFI_OLD_LIBRARY"),
                    reason="NINFER_KV_FFI_OLD_LIBRARY (a library built before the options) is not set")
def test_plain_outputs_equal_the_previous_library_bit_for_bit():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "old.npz")
        env = dict(os.environ, NINFER_KV_FFI_LIBRARY=os.environ["NINFER_KV_FFI_OLD_LIBRARY"])
        subprocess.run([sys.executable, "-c", _OLD_SCRIPT.format(repo=str(REPO), out=path)], env=env, check=True,
                       cwd=REPO, capture_output=True)
        old = dict(np.load(path))
    new = _plain_outputs()
    assert sorted(old) == sorted(new)
    for key in new:
        assert old[key].tobytes() == new[key].tobytes(), key
