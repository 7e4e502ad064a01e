"""Pallas kernel tests: the wide sweeps are marked ``slow`` and skipped unless asked for.

Run them with ``-m slow`` or with ``NINFER_KV_SLOW=1`` in the environment.
"""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: wide interpret-mode sweep (skipped unless -m slow or NINFER_KV_SLOW=1)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NINFER_KV_SLOW") == "1" or "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow sweep: run with -m slow or NINFER_KV_SLOW=1")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            item.add_marker(skip)
