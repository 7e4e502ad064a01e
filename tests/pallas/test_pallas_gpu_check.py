"""bench/gpu_check.py runs its CPU smoke (interpret mode, correctness only) and its timing rehearsal."""

import importlib.util
import pathlib
import sys

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_smoke_passes(capsys):
    rc = _load().main(["--cpu-smoke", "--profiles", "k8v4", "--orders", "head-major"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 failing checks" in out
    assert out.count("| PASS |") == 5


@pytest.mark.slow
def test_timing_rehearsal_runs(capsys):
    rc = _load().main(["--cpu-smoke", "--profiles", "bf16", "--orders", "page-major", "--rehearse-timing"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ERROR" not in out and "Traceback" not in out, out
    assert "| JAX peer | bf16 | head-major |" in out
