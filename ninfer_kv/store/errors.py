"""The KV store's errors (defined in :mod:`ninfer_kv.errors`, a leaf every layer may import)."""

from __future__ import annotations

from ..errors import *  # noqa: F401,F403
from ..errors import __all__  # noqa: F401
