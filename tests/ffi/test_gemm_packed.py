"""The packed weight products (ffi_products.matmul_bf16_packed, ffi/src/gemm_packed.cc).

Checked bit for bit against a numpy emulation of the defined order of the form in use (the pairs
order: per pair of K a fused multiply-add of the odd elements, then of the even ones; the AMX
orders: per chunk of 32 two chains and a sum, or one chain; denormal inputs as zero, tiny results
flushed after rounding), across row counts and row positions (batch invariance), across the
instruction-set levels and the AMX / VDPBF16PS / float32-FMA forms (one subprocess each), on data
with denormals, signed zeros and magnitudes from 1e-20 to 1e15.  The AMX forms run where the CPU
has AMX-BF16; everywhere, their numpy emulation is held to the library's scalar definition (the one
the library holds the hardware to before it uses AMX).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_kv.ops.ffi import products as ffi_products

from ninfer_kv.ops.ffi import handlers as ffi_handlers
from ninfer_kv.ops.ffi.packed_weight import PackedWeight, pack_bf16_weight, unpack_bf16_weight

pytestmark = pytest.mark.skipif(not ffi_handlers.is_available(), reason="FFI library unavailable")

REPO = Path(__file__).resolve().parents[2]
TINY = np.float32(2.0**-126)
FLUSH_BELOW = 2.0**-126 - 2.0**-151  # x86 FTZ: tiny after rounding


def _daz(a: np.ndarray) -> np.ndarray:
    return np.where(np.abs(a) < TINY, np.copysign(np.float32(0), a), a).astype(np.float32)


def _fma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc + a * b rounded once to float32, tiny results flushed: a product of bfloat16 values is exact
    in float64, and the float64 sum of it and a float32 rounds to the float32 fused result."""
    return _ftz(acc.astype(np.float64) + a.astype(np.float64) * b.astype(np.float64))


def _ftz(d: np.ndarray) -> np.ndarray:
    f = d.astype(np.float32)
    return np.where(np.abs(d) < FLUSH_BELOW, np.copysign(np.float32(0), f), f).astype(np.float32)


def reference(x: np.ndarray, w: np.ndarray, order: str = "pairs") -> np.ndarray:
    """The defined order of a form in numpy: ``"pairs"`` (VDPBF16PS, FMA) or an AMX order
    (``"amx-chunks"``, ``"amx-pairs"``: K padded to a multiple of 32)."""
    xf, wf = _daz(x.astype(np.float32)), _daz(w.astype(np.float32))
    chunk = 2 if order == "pairs" else 32
    pad = -x.shape[1] % chunk
    xf, wf = np.pad(xf, ((0, 0), (0, pad))), np.pad(wf, ((0, 0), (0, pad)))
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    outer = lambda k: (xf[:, k][:, None], wf[:, k][None, :])  # noqa: E731
    for c in range(0, xf.shape[1], chunk):
        if order == "pairs":
            acc = _fma(acc, *outer(c + 1))
            acc = _fma(acc, *outer(c))
        elif order == "amx-pairs":
            for k in range(c, c + chunk):
                acc = _fma(acc, *outer(k))
        elif order == "amx-chunks":
            even = odd = np.zeros_like(acc)
            for k in range(c, c + chunk, 2):
                even, odd = _fma(even, *outer(k)), _fma(odd, *outer(k + 1))
            acc = _ftz(acc.astype(np.float64) + _ftz(even.astype(np.float64) + odd.astype(np.float64)))
        else:
            raise ValueError(order)
    return acc


def order_of(kernel: str) -> str:
    """The defined order of a form of ffi_products.PACKED_KERNELS."""
    return kernel if kernel.startswith("amx") else "pairs"


def hard_values(rng, shape) -> np.ndarray:
    """bfloat16 values with denormals, +-0 and magnitudes from 1e-20 to 1e15 (products stay finite)."""
    scale = rng.choice(np.array([1.0, 1.0, 1e-20, 1e-39, 1e15, 1e-19], np.float32), shape)
    v = (rng.standard_normal(shape) * scale).astype(np.float32)
    v[rng.random(shape) < 0.05] = 0.0
    v[rng.random(shape) < 0.05] = -0.0
    return v.astype(ml_dtypes.bfloat16)


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("m,n,k", [(1, 70, 33), (5, 64, 64), (7, 130, 1), (13, 200, 300), (3, 1, 2)])
def test_matches_defined_order(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x, w = hard_values(rng, (m, k)), hard_values(rng, (n, k))
    out = ffi_products.matmul_bf16_packed(jnp.asarray(x), pack_bf16_weight(jnp.asarray(w)))
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_array_equal(bits(out), bits(reference(x, w, order_of(ffi_products.packed_kernel()))))


@pytest.mark.parametrize("order", ["amx-chunks", "amx-pairs"])
@pytest.mark.parametrize("m,n,k", [(17, 80, 93), (2, 3, 64), (1, 5, 1)])
def test_amx_orders_numpy_equals_library_definition(order, m, n, k):
    """The numpy AMX orders equal the library's scalar definition of them (packed_order.h) on every CPU,
    and differ from the pairs order on hard data."""
    rng = np.random.default_rng(m + n + k)
    x, w = hard_values(rng, (m, k)), hard_values(rng, (n, k))
    want = reference(x, w, order)
    np.testing.assert_array_equal(bits(ffi_products.packed_amx_reference(x, w, order)), bits(want))
    # on model-like data the orders round differently
    x, w = (rng.standard_normal((s, 256)).astype(ml_dtypes.bfloat16) for s in (8, 64))
    assert not np.array_equal(bits(reference(x, w, order)), bits(reference(x, w)))


def test_amx_form_where_the_cpu_has_it():
    """A CPU with AMX-BF16 runs the AMX form (its order checked once, bit for bit, by the library);
    every other CPU says why not.  Asked in a fresh process: Linux refuses the tile state to a process
    whose alternate signal stacks are too small for it, and pytest's faulthandler installs one."""
    probe = ("from ninfer_kv.ops.ffi import products as ffi_products, handlers as ffi_handlers; import json; "
             "print(json.dumps([ffi_products.packed_kernel(), ffi_products.packed_amx_status(), ffi_handlers.info().cpu_features]))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "NINFER_KV_FFI_AMX", "NINFER_KV_FFI_BF16")}
    r = subprocess.run([sys.executable, "-c", probe], env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    kernel, why, features = json.loads(r.stdout.strip().splitlines()[-1])
    assert kernel in ffi_products.PACKED_KERNELS
    if "amx-bf16" not in features:
        assert not kernel.startswith("amx") and why
        pytest.skip(f"no AMX form here ({why}); it runs on CPUs with AMX-BF16")
    assert kernel.startswith("amx"), f"AMX-BF16 present but not used: {why}"
    assert why == ""


def test_amx_reference_rejects_bad_arguments():
    x = np.zeros((2, 4), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"order must be one of .* got 'pairs'"):
        ffi_products.packed_amx_reference(x, x, "pairs")
    with pytest.raises(ValueError, match=r"w must be a bfloat16 matrix, got float32"):
        ffi_products.packed_amx_reference(x, np.zeros((2, 4), np.float32), "amx-chunks")
    with pytest.raises(ValueError, match=r"x \(2, 4\) and w \(2, 3\)"):
        ffi_products.packed_amx_reference(x, np.zeros((2, 3), ml_dtypes.bfloat16), "amx-chunks")


def test_row_alone_equals_row_in_any_batch():
    rng = np.random.default_rng(7)
    k, n = 96, 150
    w = pack_bf16_weight(jnp.asarray(hard_values(rng, (n, k))))
    row = hard_values(rng, (1, k))
    alone = bits(ffi_products.matmul_bf16_packed(jnp.asarray(row), w))[0]
    for m in (2, 3, 5, 6, 7, 12, 13, 31, 70):
        batch = hard_values(rng, (m, k))
        for pos in sorted({0, m // 2, m - 1}):
            batch[pos] = row[0]
            got = bits(ffi_products.matmul_bf16_packed(jnp.asarray(batch), w))[pos]
            np.testing.assert_array_equal(got, alone, err_msg=f"M={m}, row {pos}")


def test_many_equals_one_call_per_weight_and_leading_dims():
    rng = np.random.default_rng(3)
    x = hard_values(rng, (2, 3, 40))
    ws = [pack_bf16_weight(jnp.asarray(hard_values(rng, (n, 40)))) for n in (64, 17, 129)]
    many = ffi_products.matmul_bf16_packed_many(jnp.asarray(x), ws)
    for w, got in zip(ws, many):
        assert got.shape == (2, 3, w.n)
        np.testing.assert_array_equal(bits(got), bits(ffi_products.matmul_bf16_packed(jnp.asarray(x), w)))


def bf16_bits(a) -> np.ndarray:
    """float32 -> bfloat16 bits, to nearest even, every NaN 0x7FC0 (the library's rounding)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, np.uint16(0x7FC0), rounded)


@pytest.mark.parametrize("m,n,k", [(1, 70, 33), (13, 200, 300), (300, 130, 64)])
def test_bfloat16_results_are_the_float32_results_rounded(m, n, k):
    """``out_dtype=bfloat16``: each result the float32 one rounded once (whole and partial tiles, row
    blocks, the hard values' infinities and NaNs), bit for bit, and XLA's rounding of finite values."""
    rng = np.random.default_rng(m + 7 * n + k)
    x, w = hard_values(rng, (m, k)), hard_values(rng, (n, k))
    x[0, : min(k, 3)] = [np.inf, -np.inf, np.nan][: min(k, 3)]
    ws = [pack_bf16_weight(jnp.asarray(w)), pack_bf16_weight(jnp.asarray(w[: max(1, n // 3)]))]
    wide = ffi_products.matmul_bf16_packed_many(jnp.asarray(x), ws)
    narrow = ffi_products.matmul_bf16_packed_many(jnp.asarray(x), ws, out_dtype=jnp.bfloat16)
    for f, b in zip(wide, narrow):
        assert b.dtype == jnp.bfloat16 and b.shape == f.shape
        got = np.asarray(b).view(np.uint16)
        np.testing.assert_array_equal(got, bf16_bits(f))
        finite = np.isfinite(np.asarray(f))
        np.testing.assert_array_equal(got[finite], np.asarray(f.astype(jnp.bfloat16)).view(np.uint16)[finite])
    with pytest.raises(ValueError, match=r"out_dtype must be float32 or bfloat16, got float16"):
        ffi_products.matmul_bf16_packed(jnp.asarray(x), ws[0], out_dtype=jnp.float16)


def test_close_to_xla_on_model_like_data():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((9, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((100, 256)) * 0.05, jnp.bfloat16)
    got = ffi_products.matmul_bf16_packed(x, pack_bf16_weight(w))
    want = jnp.matmul(x, w.T, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_packed_weight_is_a_pytree_and_unpacks():
    rng = np.random.default_rng(11)
    w = hard_values(rng, (70, 33))
    pw = pack_bf16_weight(jnp.asarray(w))
    assert pw.data.shape == (2, 17, 128) and pw.shape == (70, 33)
    leaves, tree = jax.tree_util.tree_flatten(pw)
    assert len(leaves) == 1 and leaves[0] is pw.data
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(back, PackedWeight) and (back.n, back.k) == (70, 33)
    flushed = _daz(w.astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(unpack_bf16_weight(pw)).view(np.uint16), flushed.view(np.uint16))
    x = jnp.asarray(hard_values(rng, (4, 33)))
    jitted = jax.jit(ffi_products.matmul_bf16_packed)(x, pw)
    np.testing.assert_array_equal(bits(jitted), bits(ffi_products.matmul_bf16_packed(x, pw)))


def test_bad_operands_raise_clear_errors():
    w = pack_bf16_weight(jnp.ones((8, 6), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x must be bfloat16, got float32"):
        ffi_products.matmul_bf16_packed(jnp.ones((2, 6), jnp.float32), w)
    with pytest.raises(ValueError, match=r"x \(2, 5\) and w\[0\] \(N=8, K=6\)"):
        ffi_products.matmul_bf16_packed(jnp.ones((2, 5), jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"w\[0\] must be a PackedWeight.*got ArrayImpl"):
        ffi_products.matmul_bf16_packed(jnp.ones((2, 6), jnp.bfloat16), jnp.ones((8, 6), jnp.bfloat16))
    with pytest.raises(ValueError, match="at least one weight"):
        ffi_products.matmul_bf16_packed_many(jnp.ones((2, 6), jnp.bfloat16), ())
    with pytest.raises(ValueError, match=r"w must be bfloat16, got float32"):
        pack_bf16_weight(jnp.ones((8, 6), jnp.float32))
    with pytest.raises(ValueError, match=r"N >= 1 and K >= 1, got shape \(8, 0\)"):
        pack_bf16_weight(jnp.ones((8, 0), jnp.bfloat16))


_LEVEL_PROBE = """
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import ml_dtypes, numpy as np, jax.numpy as jnp
from ninfer_kv.ops.ffi import products as ffi_products, handlers as ffi_handlers
from ninfer_kv.ops.ffi.packed_weight import pack_bf16_weight
d = {k: v.view(ml_dtypes.bfloat16) for k, v in np.load(sys.argv[1]).items()}
x, w = jnp.asarray(d["x"]), [pack_bf16_weight(jnp.asarray(d["w"]))]
outs = ffi_products.matmul_bf16_packed_many(x, w)
rounded = ffi_products.matmul_bf16_packed_many(x, w, out_dtype=jnp.bfloat16)
np.savez(sys.argv[2], out=np.asarray(outs[0]), out_bf16=np.asarray(rounded[0]).view(np.uint16), isa=ffi_handlers.info().isa,
         kernel=ffi_products.packed_kernel())
"""


@pytest.mark.parametrize("matrix", ["each-level", pytest.param("every-pair", marks=pytest.mark.slow)])
def test_levels_and_bf16_form_bit_identical(tmp_path, matrix):
    """Every supported level with float32 FMAs, and the best level with its BF16 form (AMX or VDPBF16PS)
    where the CPU has one, give the bits of their form's order (``-m slow``: every level with both)."""
    rng = np.random.default_rng(21)
    x, w = hard_values(rng, (11, 301)), hard_values(rng, (150, 301))
    wants = {}
    inp = tmp_path / "in.npz"
    np.savez(inp, x=x.view(np.uint16), w=w.view(np.uint16))
    supported = ffi_handlers.info().supported
    if matrix == "every-pair":
        runs = [(level, flag) for level in supported for flag in ("1", "0")]
    else:
        runs = [(supported[0], "1")] + [(level, "0") for level in supported]
    procs = {}
    for level, flag in runs:
        env = dict(os.environ, NINFER_KV_FFI_ISA=level, NINFER_KV_FFI_BF16=flag, JAX_PLATFORMS="cpu")
        out = tmp_path / f"{level}-{flag}.npz"
        procs[(level, flag)] = out, subprocess.Popen([sys.executable, "-c", _LEVEL_PROBE, str(inp), str(out)], env=env,
                                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    forms = set()
    for key, (out, proc) in procs.items():
        log = proc.communicate(timeout=240)[0]
        assert proc.returncode == 0, f"{key}: {log[-2000:]}"
        got = np.load(out)
        kernel = str(got["kernel"])
        assert str(got["isa"]) == key[0]
        forms.add(kernel)
        if key[1] == "0":
            assert kernel == "fma"
        order = order_of(kernel)
        if order not in wants:
            wants[order] = reference(x, w, order)
        np.testing.assert_array_equal(bits(got["out"]), bits(wants[order]),
                                      err_msg=f"level {key[0]}, BF16={key[1]}, {kernel}")
        np.testing.assert_array_equal(got["out_bf16"], bf16_bits(wants[order]),
                                      err_msg=f"bfloat16 results, level {key[0]}, BF16={key[1]}, {kernel}")
    assert "fma" in forms


def test_compiles_for_aarch64(tmp_path):
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        if os.environ.get("CI") == "true":
            pytest.fail("aarch64-linux-gnu-g++ missing; CI must compile the NEON level")
        pytest.skip("no aarch64 cross compiler")
    inc = jax.ffi.include_dir()
    cmd = [cxx, "-std=gnu++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-psabi", "-Werror",
           "-ffp-contract=fast", "-DNINFER_KV_ISA_ID=neon", f"-I{REPO / 'ffi' / 'src'}", f"-isystem{inc}", "-c",
           str(REPO / "ffi" / "src" / "gemm_packed.cc"), "-o", str(tmp_path / "gemm_packed.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
