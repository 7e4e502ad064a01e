"""Static configuration of the decoder and of its step functions.

:class:`ModelConfig` describes a pre-norm decoder with GQA attention, RoPE and a SwiGLU MLP, with the
options that separate the Hugging Face families it serves: per-head QK RMSNorm (Qwen3), q/k/v biases
(Qwen2/2.5), biases on every attention projection and on the MLP (Llama's ``attention_bias`` and
``mlp_bias``), tied input and output embeddings (no copy: the LM head reads the embedding matrix), and
RoPE scaling as transformers defines it (:class:`RopeScaling`: ``linear``, ``llama3``, ``yarn``).

All classes are frozen, hashable dataclasses: they are closed over by the jitted step functions
(part of the graph key), never passed per step.  Nothing in them varies between steps.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ninfer_kv.schema.buckets import DEFAULT_BATCH_BUCKETS
from ninfer_kv.schema.geometry import PAGE_SIZE
from ninfer_kv.schema.integers import check_int
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.planning import ModelKVConfig
from ninfer_kv.ops.registry import impl_choices
from ninfer_kv.schema.profiles import KVProfile

from .layers import Products

__all__ = ["ModelConfig", "RopeScaling", "ROPE_SCALING_KINDS", "StepConfig", "DEFAULT_TOKEN_BUCKETS", "PREFILL_CHUNK"]

"""Allowed values of :attr:`StepConfig.impl` (forwarded to ``ninfer_kv.ops``)."""

DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
"""Token counts the ragged step is compiled for; a ragged batch is padded up to one."""

PREFILL_CHUNK = 128
"""Tokens per chunked-prefill call (two pages of 64)."""

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid; it must be a finite number > 0")
    return float(value)


ROPE_SCALING_KINDS = ("linear", "llama3", "yarn")
"""RoPE scaling kinds :class:`RopeScaling` implements (transformers' ``rope_type`` names)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers' ``modeling_rope_utils`` computes it.

    Attributes:
      kind: ``"linear"`` (every inverse frequency divided by ``factor``), ``"llama3"`` (Llama 3.1:
        long wavelengths divided by ``factor``, short ones kept, a smooth ramp between) or ``"yarn"``
        (YaRN, as Qwen3 documents it for long context: an interpolation/extrapolation ramp between
        ``beta_fast`` and ``beta_slow`` rotations, and cos/sin multiplied by ``attention_factor``).
      factor: the scaling factor (> 0).
      original_max_position_embeddings: the pre-training context (``llama3`` and ``yarn``).
      low_freq_factor, high_freq_factor: ``llama3``'s wavelength bounds.
      beta_fast, beta_slow: ``yarn``'s ramp bounds (rotations).
      attention_factor: ``yarn``'s cos/sin multiplier; ``None`` derives it like transformers:
        ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
        ``0.1 * ln(factor) + 1`` (1 for ``factor <= 1``).
      mscale, mscale_all_dim: see ``attention_factor``.
      truncate: ``yarn``: round the ramp bounds outward to whole dimensions (transformers' default).
    """

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"rope scaling kind={self.kind!r} is not supported; allowed: {', '.join(ROPE_SCALING_KINDS)}")
        object.__setattr__(self, "factor", _positive_float("rope scaling factor", self.factor))
        if self.kind in ("llama3", "yarn"):
            if self.original_max_position_embeddings is None:
                raise ValueError(f"rope scaling {self.kind!r} needs original_max_position_embeddings (an integer >= 1)")
            object.__setattr__(self, "original_max_position_embeddings",
                               check_int("original_max_position_embeddings", self.original_max_position_embeddings, 1))
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope scaling llama3: high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate={self.truncate!r} must be a bool")

    def inv_freq(self, head_dim: int, theta: float) -> np.ndarray:
        """float32 ``(head_dim / 2,)`` inverse frequencies (transformers' formulas, float32 arithmetic)."""
        from .layers import scaled_inv_freq  # the formulas live beside the rotation

        return scaled_inv_freq(head_dim, theta, self)

    @property
    def cos_sin_scale(self) -> float:
        """The multiplier of cos and sin: ``yarn``'s attention factor, 1 otherwise."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * float(np.log(scale)) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
        return mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A pre-norm decoder: GQA attention (optional per-head QK RMSNorm, optional biases), RoPE, SwiGLU.

    The defaults are the small Qwen3-style model of the demo and the tests (QK-norm on, no biases,
    an untied LM head, plain RoPE); :func:`ninfer_kv.models.hf.model_config_from_hf` maps a Hugging
    Face ``config.json`` onto the options.  RMSNorm follows transformers' cast order: normalize in
    float32, cast to the activation dtype, multiply by the gain in that dtype (identical to the
    float32 product for a float32 model).

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
      dtype: activation and weight dtype, ``"float32"`` or ``"bfloat16"``; norm statistics,
        softmax and logits are always float32.
      qk_norm: RMSNorm over each query and key head before RoPE (Qwen3); off for Qwen2, Llama, Mistral.
      qkv_bias: biases on the q, k and v projections (Qwen2/2.5, Llama's ``attention_bias``).
      o_bias: a bias on the output projection (Llama's ``attention_bias``).
      mlp_bias: biases on the three MLP projections (Llama's ``mlp_bias``).
      tie_embeddings: the LM head is the embedding matrix (no ``lm_head`` parameter, no copy).
      rope_scaling: a :class:`RopeScaling`, or ``None`` for plain RoPE.
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
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            check_int(name, getattr(self, name), 1)
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
        for name in ("qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling or None")

    @property
    def jnp_dtype(self):
        """The activation and weight dtype as a JAX dtype."""
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
      impl: op implementation, one of :func:`ninfer_kv.ops.registry.impl_choices` (``"auto"``: FFI on CPU,
        Pallas on GPU, Mosaic on TPU).
      prefill_chunk: tokens per chunked-prefill call (a multiple of the page size 64).
      draft_window: speculative draft window K; verify takes ``K + 1`` tokens per row.
      batch_buckets: the batch sizes a step accepts (default
        :data:`~ninfer_kv.schema.buckets.DEFAULT_BATCH_BUCKETS`); pad smaller batches up to a bucket
        (:func:`ninfer_kv.models.decoder.padding.pad_rows`).
      token_buckets: the token counts ``N`` the ragged step accepts (strictly increasing); pad a
        ragged batch with :func:`ninfer_kv.models.decoder.padding.pad_ragged`.
      products: how the weight products run when the ops are the FFI's (a CPU): ``"auto"``
        (default: this CPU's fastest per row count: the packed products where they use AMX or
        AVX512_BF16, batch invariant there; elsewhere the FFI row kernel for single-row products
        and XLA's dots for more), ``"xla"``
        (XLA's dots only) or ``"batch_invariant"`` (a row's logits never depend on the batch); see
        :class:`ninfer_kv.models.decoder.layers.Products` and docs/MODELS.md.  Other
        implementations always use XLA's dots.
    """

    model: ModelConfig = ModelConfig()
    profile: KVProfile = KVProfile.BF16
    impl: str = "auto"
    prefill_chunk: int = PREFILL_CHUNK
    draft_window: int = 3
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    products: str = "auto"
    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS

    def __post_init__(self):
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        self.profile.check_head_dim(self.model.head_dim)
        if self.impl not in impl_choices():
            raise ValueError(f"impl={self.impl!r} is not supported; allowed: {', '.join(impl_choices())}")
        allowed = tuple(m.value for m in Products)
        if self.products not in allowed:
            raise ValueError(f"products={self.products!r} is not supported; allowed: {', '.join(allowed)}")
        chunk = check_int("prefill_chunk", self.prefill_chunk, PAGE_SIZE)
        if chunk % PAGE_SIZE:
            raise ValueError(f"prefill_chunk={chunk} must be a multiple of the page size {PAGE_SIZE}")
        check_int("draft_window", self.draft_window, 1)
        for name in ("batch_buckets", "token_buckets"):
            buckets = tuple(getattr(self, name))
            if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a non-empty tuple of integers >= 1")
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(f"{name}={buckets!r} must be strictly increasing")
            object.__setattr__(self, name, buckets)

    @property
    def main_layout(self) -> PagedKVStorageLayout:
        return self.model.main_layout(self.profile)

    @property
    def mtp_layout(self) -> PagedKVStorageLayout:
        return self.model.mtp_layout(self.profile)
