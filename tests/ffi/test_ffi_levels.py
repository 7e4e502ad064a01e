"""Every instruction-set level this CPU can run stores the same codes and agrees on attention.

Each level is forced with ``NINFER_KV_FFI_ISA`` in its own subprocess (``level_probe.py``), all of
them at once; their planes must be bit-identical to each other and to the codec rules (the numpy
oracle, NaN / inf / zero / subnormal groups included), and their attention outputs must agree
with a float64 oracle to float32 rounding.  Levels that cannot run here are refused with a clear
error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ninfer_kv.ops.ffi import handlers as ffi_handlers
from tests.conformance import np_codecs
from tests.conformance.checks import assert_attention_close

from . import level_probe as probe
from .test_ffi_arithmetic import FLOAT32_TOL, int8x2_bound

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")

PACKAGE_ROOT = Path(ffi_handlers.__file__).resolve().parents[3]  # the ninfer_kv this test imports
KNOWN_LEVELS = ("native", "avx512vnni", "avx512", "avx2", "baseline", "neon")


def _env(level: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NINFER_KV_FFI_ISA"}
    env.update(
        NINFER_KV_FFI_ISA=level,
        NINFER_KV_FFI_LIBRARY=ffi_handlers.library_path(),  # the library this process loaded
        NINFER_KV_FFI_THREADS="2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """level -> the probe's saved arrays, for every level this CPU supports (run in parallel)."""
    tmp = tmp_path_factory.mktemp("levels")
    procs = {}
    for level in ffi_handlers.info().supported:
        out = tmp / f"{level}.npz"
        cmd = [sys.executable, str(Path(probe.__file__)), str(out)]
        procs[level] = (out, subprocess.Popen(cmd, env=_env(level), stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    saved = {}
    for level, (out, proc) in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"probe at level {level} failed:\n{log.decode(errors='replace')}"
        with np.load(out) as f:
            saved[level] = {name: f[name] for name in f.files}
    return saved


def test_info_reports_the_level_in_use():
    info = ffi_handlers.info()
    assert info.compiled and set(info.compiled) <= set(KNOWN_LEVELS)
    assert info.supported and set(info.supported) <= set(info.compiled)
    assert list(info.supported) == [lv for lv in info.compiled if lv in info.supported]  # best first
    assert info.isa in info.supported
    if not info.forced:
        assert info.isa == info.supported[0]
    assert info.vector_width == (16 if info.isa in ("avx512", "avx512vnni") else info.vector_width)
    assert info.vector_width in (8, 16) and info.threads >= 1
    assert info.isa in info.summary() and Path(info.library) == Path(ffi_handlers.library_path())


def test_each_forced_level_is_the_one_in_use(results):
    assert set(results) == set(ffi_handlers.info().supported)
    for level, saved in results.items():
        assert str(saved["isa"]) == level


def _stored(planes: dict, name: str, dtype) -> np.ndarray:
    """Plane `name` (saved as bytes) viewed with its dtype and shape (1, N, H, P, X)."""
    raw = planes[name]
    return raw.view(dtype).reshape(raw.shape[:-1] + (raw.shape[-1] // np.dtype(dtype).itemsize,))


def _expected_planes(profile: str, k: np.ndarray, v: np.ndarray, like: dict) -> dict[str, np.ndarray]:
    """Zeroed planes with the oracle's codes of tokens t < valid[b] scattered where append puts them."""
    codes = np_codecs.encode_kv(profile, k, v)
    out = {}
    for name, c in codes.items():
        c = np.ascontiguousarray(c)
        raw = c.view(np.uint8).reshape(c.shape[:-1] + (-1,))
        plane = np.zeros_like(like[name])
        for b in range(probe.B):
            for t in range(int(probe.VALID[b])):
                p = int(probe.POSITIONS[b]) + t
                page = probe.TABLE[probe.TABLE_ROWS[b], p // 64]
                plane[0, page, :, p % 64, :] = raw[b, t]
        out[name] = plane
    return out


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the oracle's NaN -> bf16 cast
@pytest.mark.parametrize("run", ["odd", "bf", "clean"])
@pytest.mark.parametrize("profile", probe.PROFILES)
def test_codes_are_bit_identical_on_every_level_and_follow_the_rules(results, profile, run):
    levels = list(results)
    first = results[levels[0]]
    x = probe.inputs()
    k, v = {"odd": (x["odd_k"], x["odd_v"]), "bf": (x["bf_k"], x["bf_v"]), "clean": (x["k"], x["v"])}[run]
    prefix = f"{profile}/{run}/"
    planes = {name[len(prefix):]: val for name, val in first.items() if name.startswith(prefix)}
    expected = _expected_planes(profile, np.asarray(k, np.float32), np.asarray(v, np.float32), planes)
    for name, want in expected.items():
        got = planes[name]
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        assert bad.size == 0, (
            f"{levels[0]} {profile} {run} plane {name}: {bad.size} bytes differ from the codec rules "
            f"(first at byte {bad[0]}: {got.reshape(-1)[bad[0]]:#04x}, expected {want.reshape(-1)[bad[0]]:#04x})"
        )
    for level in levels[1:]:
        for name in planes:
            np.testing.assert_array_equal(results[level][prefix + name], planes[name], err_msg=f"{level} vs {levels[0]}")


def test_nan_groups_store_the_nan_scale_and_zero_codes(results):
    """The rules themselves, spelled out for one level (the oracle comparison covers the rest)."""
    saved = next(iter(results.values()))
    # k[0, 0, 0, 5] is NaN: row 0 / token 0 / head 0 lives in page TABLE[2, 0] = 4, column 0.
    page = probe.TABLE[probe.TABLE_ROWS[0], 0]
    i8_scale = _stored({"s": saved["int8-g64/odd/k_scale"]}, "s", np.uint16)[0, page, 0, 0]
    i8_code = saved["int8-g64/odd/k"][0, page, 0, 0]
    assert i8_scale[0] == 0x7FC0 and not i8_code[:64].any() and i8_code[64:].size == 0
    fp8_scale = _stored({"s": saved["fp8-e4m3fn-row256/odd/k_scale"]}, "s", np.uint16)[0, page, 0, 0]
    assert fp8_scale[0] == 0x7FC0 and not saved["fp8-e4m3fn-row256/odd/k"][0, page, 0, 0].any()
    nv_scale = saved["nvfp4-g16/odd/k_scale"][0, page, 0, 0]
    assert nv_scale[0] == 0x7F and not saved["nvfp4-g16/odd/k"][0, page, 0, 0, :8].any()
    # k[0, 1, 1, 20] = +inf: INT8 / FP8 scale +inf and codes 0; NVFP4 scale 448 (0x7E)
    assert _stored({"s": saved["int8-g64/odd/k_scale"]}, "s", np.uint16)[0, page, 1, 1, 0] == 0x7F80
    assert not saved["int8-g64/odd/k"][0, page, 1, 1].any()
    assert saved["nvfp4-g16/odd/k_scale"][0, page, 1, 1, 1] == 0x7E
    # BF16 codes: every NaN (any sign or payload, float32 or bfloat16 input) is 0x7FC0
    for run in ("odd", "bf"):
        codes = _stored({"c": saved[f"bf16/{run}/k"]}, "c", np.uint16)
        nan = (codes & 0x7FFF) > 0x7F80
        assert nan.any() and (codes[nan] == 0x7FC0).all()
        vcodes = _stored({"c": saved[f"bf16/{run}/v"]}, "c", np.uint16)
        vnan = (vcodes & 0x7FFF) > 0x7F80
        assert vnan.any() and (vcodes[vnan] == 0x7FC0).all()


@pytest.mark.parametrize("profile", probe.PROFILES)
def test_attention_agrees_with_the_oracle_on_every_level(results, profile):
    first = next(iter(results.values()))
    x = probe.inputs()
    prefix = f"{profile}/clean/"
    planes = {name[len(prefix):]: val for name, val in first.items() if name.startswith(prefix)}
    tokens = {}
    for name, raw in planes.items():
        rows = np.stack(
            [
                np.stack([raw[0, probe.TABLE[probe.TABLE_ROWS[b], t // 64], :, t % 64] for t in range(probe.T)])
                for b in range(probe.B)
            ]
        )  # (B, T, H, bytes)
        dtype = np_codecs.encode_kv(profile, x["k"][:1, :1], x["v"][:1, :1])[name].dtype
        tokens[name] = rows.view(dtype)
    k, v = np_codecs.decode_kv(profile, tokens)
    j = np.arange(probe.T)
    qpos = probe.Q_POSITIONS[:, None] + np.arange(2)[None, :]
    visible = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < probe.KV_LENS[:, None, None])
    visible &= j[None, None, :] < probe.VALID[:, None, None]
    want = np_codecs.attention(x["q"], k, v, visible, 1.0 / np.sqrt(probe.D))
    for level, saved in results.items():
        scores, values = (str(a) for a in saved[f"{profile}/arithmetic"])
        if (scores, values) == ("float32", "float32"):
            assert_attention_close(saved[f"{profile}/attention"], want, backend="ffi", q_dtype=np.float32, what=level)
        else:  # int8x2 scores (test_ffi_arithmetic.py): within the bound of the query's rounding
            assert (scores, values) == ("int8x2", "float32"), (level, scores, values)
            got = saved[f"{profile}/attention"].astype(np.float64)
            bound = int8x2_bound(x["q"], k, v, 1.0 / np.sqrt(probe.D)) + FLOAT32_TOL * (1 + np.abs(want))
            assert np.isfinite(got).all() and (np.abs(got - want) <= bound).all(), level


_IMPORT_PROBE = (
    "import ninfer_kv.ops.ffi.handlers as f\n"
    "print(f.is_available()); print(f.load_error())\n"
    "try:\n    f.info()\nexcept f.FFIUnavailableError as e:\n    print('raised', e)\n"
)


def test_levels_that_cannot_run_are_refused_with_a_clear_error():
    info = ffi_handlers.info()
    absent = next(lv for lv in ("neon", "avx2") if lv not in info.compiled)
    cases = {absent: "is not a level of this library", "sse9": "is not a level of this library"}
    for level in info.compiled:
        if level not in info.supported:  # only on CPUs that lack a compiled-in level
            cases[level] = "is refused: this CPU lacks"
    procs = {
        level: subprocess.Popen([sys.executable, "-c", _IMPORT_PROBE], env=_env(level), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        for level in cases
    }
    for level, why in cases.items():
        out, err = procs[level].communicate(timeout=120)
        assert procs[level].returncode == 0, err
        assert out.startswith("False\n"), out
        assert f"NINFER_KV_FFI_ISA={level} {why}" in out, out
        assert ",".join(info.supported if "lacks" in why else info.compiled) in out, out
        assert "raised" in out, out
