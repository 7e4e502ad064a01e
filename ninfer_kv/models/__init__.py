"""Models that run over the paged KV cache.

* :mod:`ninfer_kv.models.qwen_tiny` — a small Qwen-style decoder (GQA, QK-norm, RoPE, SwiGLU, an
  optional MTP head) with jitted chunked-prefill / decode / verify / MTP step functions whose
  attention goes only through ``ninfer_kv.ops``, and dense no-cache references.  It is what the
  ``ninfer-kv demo`` serving loop, the examples and the end-to-end tests run.

Submodules are imported on demand; importing :mod:`ninfer_kv` does not import any model.
"""
