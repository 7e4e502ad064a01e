"""A pre-norm decoder in plain JAX whose attention reads and writes the paged KV cache only through
``ninfer_kv.ops``, with jitted step functions (chunked prefill, decode, speculative verify, MTP
drafting) that decode greedily or sample, and dense references.

Its options (:class:`ModelConfig`: QK-norm, attention and MLP biases, tied embeddings, RoPE scaling,
per-layer sliding windows, attention and final logit soft caps, a query scale, Gemma's ``(1 + w)``
and sandwich norms, a GELU-tanh MLP, scaled embeddings, a RoPE of the sliding layers' own) cover
Hugging Face Qwen3, Qwen2/2.5, Llama 2/3/3.1, Mistral, Gemma 2 and Gemma 3 checkpoints, which
:mod:`ninfer_kv.models.hf` loads; with its defaults it is the small Qwen3-style model of the demo
and the tests.

Modules: ``config`` (ModelConfig, RopeScaling, StepConfig), ``weights`` (init_params,
param_shapes), ``layers`` (RMSNorm, RoPE with scaling, SwiGLU, GeGLU), ``model`` (paged forward), ``mtp``
(MTP head), ``sampling`` (greedy / temperature / top-k / top-p with per-sequence keys), ``steps``
(jitted steps with compile counters), ``dense`` (no-cache and contiguous-cache references),
``padding`` (padding rows), ``mesh_steps`` (steps over a sharded cache).  The batch buckets live
in :mod:`ninfer_kv.schema.buckets`.
"""

from .config import PREFILL_CHUNK, ROPE_SCALING_KINDS, ModelConfig, RopeScaling, StepConfig
from .padding import PaddedRows, pad_rows, prompt_chunks
from .dense import (
    DenseCacheSteps,
    DenseKVCache,
    dense_greedy_generate,
    dense_logits,
    dense_mtp_forward,
    init_dense_cache,
    make_dense_cache_steps,
)
from .steps import (
    CompileCounter,
    CountedStep,
    DecodeOutput,
    ModelSteps,
    MTPDraftOutput,
    MTPExtendOutput,
    PrefillOutput,
    VerifyOutput,
    make_steps,
    shared_steps,
)
from .sampling import GREEDY, SamplingConfig, SamplingRows, sample_tokens, sampling_rows, sequence_key
from .weights import init_params, pack_params, param_count, param_shapes

__all__ = [
    "PaddedRows",
    "pad_rows",
    "prompt_chunks",
    "PREFILL_CHUNK",
    "ModelConfig",
    "RopeScaling",
    "ROPE_SCALING_KINDS",
    "StepConfig",
    "GREEDY",
    "SamplingConfig",
    "SamplingRows",
    "sample_tokens",
    "sampling_rows",
    "sequence_key",
    "DenseCacheSteps",
    "DenseKVCache",
    "dense_greedy_generate",
    "dense_logits",
    "dense_mtp_forward",
    "init_dense_cache",
    "make_dense_cache_steps",
    "CompileCounter",
    "CountedStep",
    "DecodeOutput",
    "ModelSteps",
    "MTPDraftOutput",
    "MTPExtendOutput",
    "PrefillOutput",
    "VerifyOutput",
    "make_steps",
    "shared_steps",
    "init_params",
    "pack_params",
    "param_count",
    "param_shapes",
]
