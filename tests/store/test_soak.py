"""The soak driver (bench/soak.py): a short run always, 10,000 sequences with ``-m soak``."""

import importlib.util
import pathlib

import pytest

_SOAK = pathlib.Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def _load():
    spec = importlib.util.spec_from_file_location("ninfer_kv_bench_soak", _SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak():
    stats = _load().run_soak(120, seed=3, check_every=5)
    assert stats["sequences"] == 120 and stats["verified"] == 120
    assert stats["forks"] > 0 and stats["moves"] > 0 and stats["retained"] > 0


@pytest.mark.soak
def test_soak_10000_sequences():
    stats = _load().run_soak(10_000, seed=0)
    assert stats["sequences"] == 10_000 and stats["verified"] == 10_000
