"""bench/gpu_check.py: its CPU rehearsal runs every section, and its append comparison can fail."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # about 40 s of interpret-mode compiles: run with -m slow before a GPU run
def test_cpu_smoke_rehearses_every_section(gpu_check, capsys):
    rc = gpu_check.main(["--cpu-smoke", "--profiles", "bf16", "--orders", "page-major"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 failing checks" in out and "Traceback" not in out and "ERROR" not in out, out
    for title in gpu_check._TITLES.values():
        assert f"## {title}" in out
    assert "| impl='auto' on a GPU | - | - | resolves to | pallas | PASS |" in out
    assert "| ours | bf16 | head-major |" in out and "| JAX peer | bf16 | head-major |" in out
    assert "best JAX peer" in out
    assert out.count("| True | PASS |") == 2  # both timed appends kept their buffers and wrote the right tokens
    assert "read-only (sum)" in out


def test_code_steps_count_code_steps(gpu_check):
    from ninfer_kv.profiles import KVCodec

    e4m3 = np.array([0x00, 0x80, 0x01, 0x81, 0x7E, 0x38], np.uint8)
    other = np.array([0x80, 0x01, 0x02, 0x01, 0x7D, 0x38], np.uint8)
    assert gpu_check._code_steps(KVCodec.FP8_E4M3FN_ROW, e4m3, other).tolist() == [0, 1, 1, 2, 1, 0]
    nib = np.array([0x10, 0x9F], np.uint8)  # (lo 0, hi 1), (lo -7, hi -1)
    assert gpu_check._code_steps(KVCodec.NVFP4_G16, nib, np.array([0x20, 0x9E], np.uint8)).tolist() == [1, 1]
    assert gpu_check._code_steps(KVCodec.INT8_G64, np.array([0x7F], np.uint8), np.array([0x81], np.uint8)).tolist() == [254]


def test_append_comparison_catches_wrong_and_stray_bytes(gpu_check):
    from ninfer_kv.ops.reference import paged_append_reference

    view, rows = gpu_check.reference_pool("int8-g64", "page-major", head_dim=64, kv_heads=1, kv_lens=[70, 10], seed=1)
    k = jax.random.normal(jax.random.key(0), (2, 3, 1, 64), jnp.float32)
    pos, valid = jnp.array([70, 10], jnp.int32), jnp.array([3, 2], jnp.int32)
    after = jax.jit(paged_append_reference)(view, jnp.asarray(rows), pos, k, k, valid)
    table = np.asarray(view.block_tables)
    ok, desc = gpu_check.compare_append(view, after, table, rows, pos, valid, k, k, exact=True)
    assert ok and "5 tokens" in desc, desc
    page, col = table[rows[0], 70 // 64], 70 % 64
    for name, where, value, expect in [
        ("k", (1, page, 0, col, 3), 1, "max step"),  # a written code one step off: allowed unless exact
        ("k", (1, page, 0, col, 3), 2, "max step 2"),  # two steps off: never allowed
        ("k_scale", (1, page, 0, col, 0), 1, "scales differing 1"),
        ("v", (1, table[rows[1], 0], 0, 40, 0), 0, "other bytes changed 1"),  # a byte no token owns
    ]:
        plane = np.array(after.planes[name]).view(np.uint16 if name.endswith("scale") else np.int8)
        plane[where] = plane[where] + value if value else plane[where] ^ 1
        bad = after.replace(planes={**after.planes, name: jnp.asarray(plane.view(after.planes[name].dtype))})
        ok, desc = gpu_check.compare_append(view, bad, table, rows, pos, valid, k, k, exact=True)
        assert not ok and expect in desc, (name, desc)
    one_step = np.array(after.planes["k"]).copy()
    one_step[1, page, 0, col, 3] += 1 if one_step[1, page, 0, col, 3] < 127 else -1
    bad = after.replace(planes={**after.planes, "k": jnp.asarray(one_step)})
    assert gpu_check.compare_append(view, bad, table, rows, pos, valid, k, k, exact=False)[0]
