"""Fixtures of the Pallas tests: ``bench``, the traffic model of ``bench/bench_ragged_traffic.py``."""

import importlib.util
import pathlib
import sys

import pytest

_TRAFFIC = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_ragged_traffic.py"


@pytest.fixture(scope="module")
def bench():
    """The traffic bench script as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("bench_ragged_traffic", _TRAFFIC)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
