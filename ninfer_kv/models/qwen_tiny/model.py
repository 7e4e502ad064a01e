"""Alias of :mod:`ninfer_kv.models.decoder.model` (the decoder generalized to Qwen3, Qwen2, Llama and Mistral).

``import ninfer_kv.models.qwen_tiny.model`` yields the very same module object, so classes, jitted functions
and compile counters are shared with code that imports the decoder's path.
"""

import sys

from ninfer_kv.models.decoder import model as _module

sys.modules[__name__] = _module
