"""A small Qwen-style decoder in plain JAX whose attention reads and writes the paged KV cache
only through ``ninfer_kv.ops``, with jitted step functions (chunked prefill, decode, speculative
verify, MTP drafting) and dense references.

Modules: ``config`` (ModelConfig, StepConfig), ``weights`` (init_params), ``layers`` (RMSNorm,
RoPE, SwiGLU), ``model`` (paged forward), ``mtp`` (MTP head), ``steps`` (jitted steps with compile
counters), ``dense`` (no-cache and contiguous-cache references), ``buckets`` (batch buckets and
padding rows).

The serving demo (``ninfer-kv demo``) and ``examples/`` run this model; ``examples.model`` is an
alias of this package kept for scripts written against the examples tree.
"""

from .buckets import PaddedRows, bucket_for, pad_rows, prompt_chunks
from .config import DEFAULT_BATCH_BUCKETS, IMPLS, PREFILL_CHUNK, ModelConfig, StepConfig
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
)
from .weights import init_params, param_count

__all__ = [
    "PaddedRows",
    "bucket_for",
    "pad_rows",
    "prompt_chunks",
    "DEFAULT_BATCH_BUCKETS",
    "IMPLS",
    "PREFILL_CHUNK",
    "ModelConfig",
    "StepConfig",
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
    "init_params",
    "param_count",
]
