"""The small Qwen-style decoder the demo, the examples and the tests run: an alias of
:mod:`ninfer_kv.models.decoder`.

The decoder was generalized (QK-norm on or off, attention and MLP biases, tied embeddings, RoPE
scaling) to serve Hugging Face Qwen3, Qwen2/2.5, Llama and Mistral checkpoints
(:mod:`ninfer_kv.models.hf`).  Every name and submodule of this package (``config``, ``weights``,
``layers``, ``model``, ``mtp``, ``steps``, ``dense``, ``buckets``, ``mesh_steps``) is the decoder's
own object: ``ninfer_kv.models.qwen_tiny.steps is ninfer_kv.models.decoder.steps``.
"""

from ninfer_kv.models.decoder import *  # noqa: F401,F403
from ninfer_kv.models.decoder import __all__  # noqa: F401
