"""Static configuration of the example decoder and of its step functions.

Both classes are frozen, hashable dataclasses: they are closed over by the jitted step functions
(part of the graph key), never passed per step.  Nothing in them varies between steps.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ninfer_kv.geometry import PAGE_SIZE
from ninfer_kv.layout import PagedKVStorageLayout
from ninfer_kv.planning import ModelKVConfig
from ninfer_kv.profiles import KVProfile

__all__ = ["ModelConfig", "StepConfig", "IMPLS", "DEFAULT_BATCH_BUCKETS", "PREFILL_CHUNK"]

IMPLS = ("auto", "pallas", "ffi", "reference")
"""Allowed values of :attr:`StepConfig.impl` (forwarded to ``ninfer_kv.ops``)."""

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Batch sizes the step functions are compiled for; smaller batches are padded up to a bucket."""

PREFILL_CHUNK = 128
"""Tokens per chunked-prefill call (two pages of 64)."""

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _int_at_least(name: str, value, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid; it must be an integer >= {minimum}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A small Qwen-style decoder (pre-norm, GQA attention with per-head QK RMSNorm, RoPE, SwiGLU).

    Attributes:
      vocab_size: vocabulary V.
      d_model: residual width.
      num_layers: decoder layers; each owns layer ``l`` of the Main pool's stacked planes.
      num_heads: query heads Hq (a multiple of ``num_kv_heads``; query head ``h`` reads KV head
        ``h // (Hq // H)``, the ops' GQA mapping).
      num_kv_heads: KV heads H.
      head_dim: head dim D (even, for RoPE); 128 by default, 256 and 64 are also common.
      mlp_dim: SwiGLU hidden width.
      rope_theta: RoPE base.
      rms_eps: RMSNorm epsilon.
      mtp: whether the model has a multi-token-prediction head (one extra layer with its own
        KV pool, used to draft tokens for speculative decoding).
      dtype: activation and weight dtype, ``"float32"`` or ``"bfloat16"``; norms, softmax and
        logits are always float32.
    """

    vocab_size: int = 512
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    mlp_dim: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    mtp: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            _int_at_least(name, getattr(self, name), 1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of dimensions)")
        if not self.rope_theta > 1.0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 1")
        if not 0.0 < self.rms_eps < 1.0:
            raise ValueError(f"rms_eps={self.rms_eps!r} must be in (0, 1)")
        if not isinstance(self.mtp, bool):
            raise ValueError(f"mtp={self.mtp!r} must be a bool")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; allowed: {', '.join(_DTYPES)}")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_config(self, profile: "KVProfile | str" = KVProfile.BF16) -> ModelKVConfig:
        """The Main pool's KV geometry with ``profile`` (input of ``ninfer_kv.plan_kv_cache``)."""
        return ModelKVConfig(self.num_layers, self.num_kv_heads, self.head_dim, KVProfile.parse(profile))

    def main_layout(self, profile: "KVProfile | str" = KVProfile.BF16) -> PagedKVStorageLayout:
        """Main pool layout: one stacked plane per plane kind over ``num_layers`` layers, page-major."""
        return PagedKVStorageLayout(profile, self.num_layers, self.num_kv_heads, self.head_dim)

    def mtp_layout(self, profile: "KVProfile | str" = KVProfile.BF16) -> PagedKVStorageLayout:
        """MTP pool layout: same profile and geometry as Main, one layer."""
        if not self.mtp:
            raise ValueError("this ModelConfig has mtp=False; it has no MTP pool")
        return PagedKVStorageLayout(profile, 1, self.num_kv_heads, self.head_dim)

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A small configuration for tests: 2 layers, d_model 128, head dim 64, vocab 256."""
        base = dict(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=256)
        base.update(overrides)
        return cls(**base)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static configuration of the jitted step functions.

    Attributes:
      model: the :class:`ModelConfig`.
      profile: the KV profile of the Main pool (and of the MTP pool when ``model.mtp``).
      impl: op implementation passed to ``ninfer_kv.ops`` (``"auto"``: Pallas on GPU, FFI on CPU).
      prefill_chunk: tokens per chunked-prefill call (a multiple of the page size 64).
      draft_window: speculative draft window K; verify takes ``K + 1`` tokens per row.
      batch_buckets: the batch sizes a step accepts; pad smaller batches up to a bucket
        (:func:`ninfer_kv.models.qwen_tiny.buckets.pad_rows`).
    """

    model: ModelConfig = ModelConfig()
    profile: KVProfile = KVProfile.BF16
    impl: str = "auto"
    prefill_chunk: int = PREFILL_CHUNK
    draft_window: int = 3
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS

    def __post_init__(self):
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        self.profile.check_head_dim(self.model.head_dim)
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not supported; allowed: {', '.join(IMPLS)}")
        chunk = _int_at_least("prefill_chunk", self.prefill_chunk, PAGE_SIZE)
        if chunk % PAGE_SIZE:
            raise ValueError(f"prefill_chunk={chunk} must be a multiple of the page size {PAGE_SIZE}")
        _int_at_least("draft_window", self.draft_window, 1)
        buckets = tuple(self.batch_buckets)
        if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
            raise ValueError(f"batch_buckets={self.batch_buckets!r} must be a non-empty tuple of integers >= 1")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"batch_buckets={buckets!r} must be strictly increasing")
        object.__setattr__(self, "batch_buckets", buckets)

    @property
    def main_layout(self) -> PagedKVStorageLayout:
        return self.model.main_layout(self.profile)

    @property
    def mtp_layout(self) -> PagedKVStorageLayout:
        return self.model.mtp_layout(self.profile)
