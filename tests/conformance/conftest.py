"""The ``backend`` fixture: every registered backend, skipped with its reason where it cannot load."""

import pytest

from .backends import BACKENDS, require


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    """The name of one registered backend; the test is skipped, with the reason, where it cannot load."""
    return require(request.param)
