"""Alias of :mod:`ninfer_kv.models.qwen_tiny.buckets` (the example model lives in the installed package).

``import examples.model.buckets`` yields the very same module object, so classes, jitted functions and
compile counters are shared with code that imports the package path.
"""

import sys

from ninfer_kv.models.qwen_tiny import buckets as _module

sys.modules[__name__] = _module
