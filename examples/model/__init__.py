"""The example decoder, re-exported from :mod:`ninfer_kv.models.qwen_tiny`.

The model lives in the installed package (so ``ninfer-kv demo`` runs from any directory after
``pip install .``); ``examples.model`` and its submodules (``examples.model.steps``,
``examples.model.dense``, ...) are aliases of the package's modules: the same module objects, the
same classes, the same jitted functions.
"""

from ninfer_kv.models.qwen_tiny import *  # noqa: F401,F403
from ninfer_kv.models.qwen_tiny import __all__  # noqa: F401
