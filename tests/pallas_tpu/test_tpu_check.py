"""bench/tpu_check.py: the ragged and engine sections' CPU rehearsal, and the JAX kernel's page layout."""

import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "tpu_check.py"


@pytest.fixture(scope="module")
def tpu_check():
    spec = importlib.util.spec_from_file_location("tpu_check", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _state():
    """The setup section's figures, as the ragged section reads them (the setup does not run here)."""
    return {"copy_bw": 1e9, "read_bw": 1e9, "nominal_bw": float("nan")}


def test_peer_kv_pages_interleave_each_heads_k_and_v(tpu_check):
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import PagedKVBatchLayerView, allocate_planes

    lay = PagedKVStorageLayout("bf16", 2, 3, 64, "page-major")
    shapes = lay.plane_shapes(5)
    planes = {n: jax.random.normal(jax.random.key(i), shapes[n], jnp.bfloat16) for i, n in enumerate(("k", "v"))}
    view = PagedKVBatchLayerView(planes, jnp.zeros((1, 2), jnp.int32), 1, lay)
    kv = np.asarray(tpu_check.peer_kv_pages(view))
    assert kv.shape == (5, 64, 6, 64)
    k, v = np.asarray(planes["k"][1]), np.asarray(planes["v"][1])  # (P, H, 64, D)
    for page, col, head in ((0, 0, 0), (4, 63, 2), (2, 17, 1)):
        assert np.array_equal(kv[page, col, 2 * head], k[page, head, col])
        assert np.array_equal(kv[page, col, 2 * head + 1], v[page, head, col])
    k8 = PagedKVStorageLayout("k8v4", 1, 3, 64, "page-major")
    with pytest.raises(ValueError, match="got k8v4 page-major"):
        tpu_check.peer_kv_pages(PagedKVBatchLayerView(allocate_planes(k8, 2), jnp.zeros((1, 2), jnp.int32), 0, k8))


def test_cpu_smoke_ragged_section_runs_beside_jax_and_checks_both(tpu_check, capsys):
    checks = tpu_check.Checks()
    tpu_check.section_ragged(tpu_check.Section("ragged", math.inf), tpu_check.SMOKE, checks, _state())
    out = capsys.readouterr().out
    assert checks.failures == 0 and checks.passed == 2, out
    assert "| 2 decodes at 192 + a 40-token chunk | bf16 | 3 / 42 |" in out
    assert "| ok: 42 tokens; codes exact 1.000000" in out
    assert "| JAX reference (CPU) | bf16 | 3 / 42 | - | - |" in out and "vs ours | PASS |" in out
    assert "ours / JAX = " in out and "Traceback" not in out and "ERROR" not in out, out


@pytest.mark.slow  # the engine section's code is gpu_check's (tests/pallas/test_pallas_gpu_check.py runs it)
def test_cpu_smoke_engine_section_through_main(tpu_check, capsys):
    rc = tpu_check.main(["--cpu-smoke", "--sections", "engine"])
    out = capsys.readouterr().out
    assert rc == 0, out
    native = tpu_check.registry.load_impl("pallas_tpu").paged_attention_ragged is not None
    assert f"| native / engine ragged rounds | {native} / {native} | PASS |" in out
    assert "| every request generated | - | - | requests / token counts | 3 / [3] | PASS |" in out
    assert "Engine on 'pallas_tpu': rounds " in out and "tokens/s" in out
    assert "0 failing checks" in out and "Traceback" not in out, out
