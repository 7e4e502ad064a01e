"""Alias of :mod:`ninfer_kv.models.qwen_tiny.model` (the example model lives in the installed package).

``import examples.model.model`` yields the very same module object, so classes, jitted functions and
compile counters are shared with code that imports the package path.
"""

import sys

from ninfer_kv.models.qwen_tiny import model as _module

sys.modules[__name__] = _module
