"""Models that run over the paged KV cache.

* :mod:`ninfer_kv.models.decoder` — a configurable decoder (Qwen3, Qwen2/2.5, Llama, Mistral, Gemma 2
  and 3 options: GQA, optional QK-norm and attention biases, RoPE with its scalings, SwiGLU or GeGLU,
  tied embeddings, sliding windows and soft caps per layer, an optional MTP head) with jitted
  chunked-prefill / decode / verify / MTP step
  functions whose attention goes only through ``ninfer_kv.ops``, sampling inside the steps, and
  dense no-cache references.  It is what the ``ninfer-kv demo`` serving loop, the examples and the
  end-to-end tests run.
* :mod:`ninfer_kv.models.hf` — Hugging Face checkpoint directories: ``config.json`` mapping,
  safetensors loading and writing, tokenizer and EOS.
* :mod:`ninfer_kv.models.generate` — :class:`~ninfer_kv.models.generate.PagedGenerator`, text
  generation through the paged store (the ``ninfer-kv generate`` command).

Submodules are imported on demand; importing :mod:`ninfer_kv` does not import any model.
"""
