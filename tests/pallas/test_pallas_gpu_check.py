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
    from ninfer_kv.schema.profiles import KVCodec

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


def test_ragged_ideal_bytes_count_live_pages_once_per_query_block(gpu_check):
    from ninfer_kv.schema.profiles import KVProfile

    page_bytes = 64 * 2 * KVProfile.BF16.token_head_bytes(128)  # a page of both KV heads
    # a decode at 100 keys: 2 pages; a chunk of 100 queries ending at 200 keys in blocks of 64: its
    # first block sees 164 keys (3 pages), its second 200 (4 pages)
    rnd = gpu_check.RaggedRound("mixed", (100, 200), (1, 100))
    assert gpu_check.ragged_ideal_bytes(rnd, "bf16", 2, 128, 64) == (2 + 3 + 4) * page_bytes
    assert gpu_check.ragged_ideal_bytes(rnd, "bf16", 2, 128, 128) == (2 + 4) * page_bytes
    assert rnd.positions.tolist() == [99, 100] and rnd.query_starts.tolist() == [0, 1, 101]
    assert gpu_check.ragged_check_slices(rnd, 16) == [(0, 0, 1), (1, 0, 16), (1, 42, 16), (1, 84, 16)]
    with pytest.raises(ValueError, match="row 1: q_lens=300"):
        gpu_check.RaggedRound("bad", (100, 200), (1, 300))
    with pytest.raises(ValueError, match="block_q=0"):
        gpu_check.ragged_ideal_bytes(rnd, "bf16", 2, 128, 0)


def test_cpu_smoke_ragged_section_checks_then_times_the_native_kernels(gpu_check, capsys):
    rc = gpu_check.main(["--cpu-smoke", "--sections", "ragged"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "impl='pallas': native ragged kernels yes" in out
    assert "| 2 decodes at 192 + a 40-token chunk | bf16 | 3 / 42 | yes | 32 |" in out  # 128 query rows: 32 tokens at GQA 4
    assert "| ok: 42 tokens; codes exact 1.000000" in out and "| PASS |" in out
    assert "0 failing checks" in out and "Traceback" not in out and "ERROR" not in out, out


def test_ragged_section_fails_on_wrong_kernels(gpu_check, capsys):
    import dataclasses
    import math

    from ninfer_kv.ops import registry

    broken = dataclasses.replace(
        registry.load_impl("reference"), name="broken",
        paged_append_ragged=lambda view, *args: view,  # writes nothing
        paged_attention_ragged=lambda q, *args, **kwargs: jnp.zeros_like(q))
    checks = gpu_check.Checks()
    with registry.override_impls({"broken": lambda: broken}):
        gpu_check.run_ragged_section(gpu_check.Section("ragged", math.inf), gpu_check.SMOKE, checks, "broken",
                                     lambda nbytes, seconds: "0 | 0%", roof_header="% of read BW")
    out = capsys.readouterr().out
    assert checks.failures == 1 and checks.passed == 0, out
    assert "| WRONG: 42 tokens;" in out and "| FAIL |" in out, out


def test_cpu_smoke_engine_section_serves_in_ragged_rounds(gpu_check, capsys):
    rc = gpu_check.main(["--cpu-smoke", "--sections", "engine"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| ragged rounds iff native ragged ops | - | - | native / engine ragged rounds | True / True | PASS |" in out
    assert "| every request generated | - | - | requests / token counts | 3 / [3] | PASS |" in out
    assert "Engine on 'pallas': rounds RAGGED; 9 tokens generated in" in out and "tokens/s" in out
    assert "0 failing checks" in out and "Traceback" not in out, out


def test_engine_section_fails_when_the_rounds_ignore_native_kernels(gpu_check, capsys, monkeypatch):
    import math

    from ninfer_kv.engine import core

    monkeypatch.setattr(core, "feeds_ragged_rounds", lambda model: False)
    checks = gpu_check.Checks()
    gpu_check.run_engine_section(gpu_check.Section("engine", math.inf), gpu_check.SMOKE, checks, "reference")
    out = capsys.readouterr().out
    assert checks.failures == 1, out
    assert "| native / engine ragged rounds | True / False | FAIL |" in out
    assert "rounds rectangular (prefill + decode units)" in out
