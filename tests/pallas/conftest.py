"""Pallas kernel tests.

The wide interpret-mode sweeps carry ``@pytest.mark.slow``; the pytest configuration deselects them by
default (``addopts`` in ``pyproject.toml``).  Run them with ``python -m pytest -m slow tests/pallas``.
"""
