"""Alias of :mod:`ninfer_kv.models.qwen_tiny.dense` (the example model lives in the installed package).

``import examples.model.dense`` yields the very same module object, so classes, jitted functions and
compile counters are shared with code that imports the package path.
"""

import sys

from ninfer_kv.models.qwen_tiny import dense as _module

sys.modules[__name__] = _module
