"""Static configuration of the decoder and of its step functions.

:class:`ModelConfig` describes a pre-norm decoder with GQA attention, RoPE and a gated MLP, with the
options that separate the Hugging Face families it serves: per-head QK RMSNorm (Qwen3, Gemma 3), q/k/v
biases (Qwen2/2.5), biases on every attention projection and on the MLP (Llama's ``attention_bias`` and
``mlp_bias``), tied input and output embeddings (no copy: the LM head reads the embedding matrix),
RoPE scaling as transformers defines it (:class:`RopeScaling`: ``linear``, ``llama3``, ``yarn``), and
Gemma's and the sliding-window families' options: per-layer sliding windows (:data:`LAYER_TYPES`),
attention and final logit soft caps, a query scale, ``(1 + w)`` RMSNorm gains, sandwich norms, a
GELU-tanh MLP, scaled embeddings and a separate RoPE for the sliding layers.

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
from ninfer_kv.planning import DEFAULT_RING_STEP_TOKENS, ModelKVConfig, WindowRings
from ninfer_kv.ops.registry import impl_choices
from ninfer_kv.schema.profiles import KVProfile

from .layers import Products

__all__ = ["ModelConfig", "RopeScaling", "ROPE_SCALING_KINDS", "StepConfig", "DEFAULT_TOKEN_BUCKETS", "PREFILL_CHUNK",
           "LAYER_TYPES", "SLIDING", "FULL", "MLP_ACTIVATIONS", "MAX_WINDOW"]

"""Allowed values of :attr:`StepConfig.impl` (forwarded to ``ninfer_kv.ops``)."""

DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
"""Token counts the ragged step is compiled for; a ragged batch is padded up to one."""

PREFILL_CHUNK = 128
"""Tokens per chunked-prefill call (two pages of 64)."""

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

SLIDING = "sliding_attention"
"""The layer type of a sliding-window layer (transformers' ``layer_types`` name)."""

FULL = "full_attention"
"""The layer type of a full-attention layer."""

LAYER_TYPES = (SLIDING, FULL)
"""Allowed entries of :attr:`ModelConfig.layer_types`."""

MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""Allowed :attr:`ModelConfig.mlp_activation`: SiLU (SwiGLU) or GELU with the tanh approximation (GeGLU)."""

MAX_WINDOW = 2**31 - 1
"""Largest :attr:`ModelConfig.sliding_window` (positions are int32)."""


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
    """A pre-norm decoder: GQA attention (optional per-head QK RMSNorm, optional biases, optional
    sliding windows and soft caps), RoPE, a gated MLP (SwiGLU or GeGLU).

    The defaults are the small Qwen3-style model of the demo and the tests (QK-norm on, no biases,
    an untied LM head, plain RoPE, full attention everywhere); :func:`ninfer_kv.models.hf.model_config_from_hf`
    maps a Hugging Face ``config.json`` onto the options.  RMSNorm follows transformers' cast order:
    normalize in float32, cast to the activation dtype, multiply by the gain in that dtype (identical
    to the float32 product for a float32 model); with ``gemma_norms`` the gain is ``1 + w`` and the
    product is taken in float32 before the one cast (Gemma's order).

    One decoder layer (bracketed parts are options)::

        a = attention(rope(q), rope(k), v) @ wo         (q, k, v of rms_norm(h, attn_norm))
        h = h + [rms_norm(a, post_attn_norm)]           (sandwich_norms)
        m = mlp(rms_norm(h, mlp_norm))                  (mlp_activation: silu or gelu_tanh)
        h = h + [rms_norm(m, post_mlp_norm)]            (sandwich_norms)

    Attributes:
      vocab_size: vocabulary V.
      d_model: residual width.
      num_layers: decoder layers; a full-attention layer owns one layer of the Main pool's stacked
        planes, a windowed one (with ``window_rings``) one layer of the window rings
        (:meth:`kv_slot`).
      num_heads: query heads Hq (a multiple of ``num_kv_heads``; query head ``h`` reads KV head
        ``h // (Hq // H)``, the ops' GQA mapping).
      num_kv_heads: KV heads H.
      head_dim: head dim D (even, for RoPE); 128 by default, 256 and 64 are also common.
      mlp_dim: the gated MLP's hidden width.
      rope_theta: RoPE base (of every layer, or of the full-attention layers when
        ``local_rope_theta`` is set).
      rms_eps: RMSNorm epsilon.
      mtp: whether the model has a multi-token-prediction head (one extra layer with its own
        KV pool, used to draft tokens for speculative decoding).
      dtype: activation and weight dtype, ``"float32"`` or ``"bfloat16"``; norm statistics,
        softmax and logits are always float32.
      qk_norm: RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3); off for Qwen2,
        Llama, Mistral, Gemma 2.
      qkv_bias: biases on the q, k and v projections (Qwen2/2.5, Llama's ``attention_bias``).
      o_bias: a bias on the output projection (Llama's ``attention_bias``).
      mlp_bias: biases on the three MLP projections (Llama's ``mlp_bias``).
      tie_embeddings: the LM head is the embedding matrix (no ``lm_head`` parameter, no copy).
      rope_scaling: a :class:`RopeScaling`, or ``None`` for plain RoPE (of every layer, or of the
        full-attention layers when ``local_rope_theta`` is set).
      layer_types: ``None`` (every layer full attention) or one of :data:`LAYER_TYPES` per layer:
        ``"sliding_attention"`` layers attend to the last ``sliding_window`` positions (and take the
        local RoPE), ``"full_attention"`` layers to every position.
      sliding_window: the window ``W`` of the sliding layers in tokens, in ``[1, MAX_WINDOW]``: a
        query at position ``p`` sees keys ``j`` with ``p - W < j <= p`` (transformers'
        ``q_idx - kv_idx < sliding_window``); ``None``: the sliding layers attend to every position
        (a window at least the served context is exactly that).
      attn_soft_cap: ``None`` or the attention logit soft cap ``c > 0``: scores become
        ``c * tanh(s / c)`` before the softmax (Gemma 2's ``attn_logit_softcapping``).
      final_soft_cap: ``None`` or the final logit soft cap ``c > 0``: logits become
        ``c * tanh(logits / c)`` (float32; Gemma's ``final_logit_softcapping``).
      query_scale: the attention's score scale (``sm_scale``); ``None``: ``head_dim ** -0.5``
        (Gemma: ``query_pre_attn_scalar ** -0.5``).
      gemma_norms: every RMSNorm (layers, QK-norm, final) multiplies by ``1 + w`` in float32 and
        casts the product once (transformers' ``GemmaRMSNorm``).
      sandwich_norms: RMSNorms on the attention output (``post_attn_norm``) and the MLP output
        (``post_mlp_norm``) before each residual add (Gemma 2 and 3).
      mlp_activation: one of :data:`MLP_ACTIVATIONS`: ``"silu"`` (SwiGLU) or ``"gelu_tanh"``
        (GELU with the tanh approximation, transformers' ``gelu_pytorch_tanh``).
      embed_scale: the embeddings are multiplied by ``sqrt(d_model)`` rounded to float32, then to the
        activation dtype (Gemma's normalizer).
      local_rope_theta: ``None`` (every layer takes ``rope_theta``) or the RoPE base of the
        ``"sliding_attention"`` layers (Gemma 3's ``rope_local_base_freq``).
      local_rope_scaling: the RoPE scaling of the sliding layers (needs ``local_rope_theta``).
      window_rings: keep the layers with a window in per-row window rings (default; only when at
        least one layer attends to every position: a model whose every layer slides keeps them all
        in the Main pool), the KV memory a window needs and no more (:mod:`ninfer_kv.planning.rings`);
        ``False``: every layer in the Main pool (meshes and speculative decoding need this).
      ring_step_tokens: the most tokens one step writes into a row of the rings (``T`` of
        :class:`~ninfer_kv.planning.rings.WindowRings`, default 512): at least the prefill chunk.
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
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    query_scale: float | None = None
    gemma_norms: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    window_rings: bool = True
    ring_step_tokens: int = DEFAULT_RING_STEP_TOKENS

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
        check_int("ring_step_tokens", self.ring_step_tokens, 1, MAX_WINDOW)
        for name in ("qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_embeddings", "gemma_norms", "sandwich_norms",
                     "embed_scale", "window_rings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        for name in ("rope_scaling", "local_rope_scaling"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), RopeScaling):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a RopeScaling or None")
        self._check_layer_types()
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", check_int("sliding_window", self.sliding_window, 1, MAX_WINDOW))
        for name in ("attn_soft_cap", "final_soft_cap", "query_scale"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} is not supported; allowed: "
                             f"{', '.join(MLP_ACTIVATIONS)}")
        if self.local_rope_theta is not None:
            theta = _positive_float("local_rope_theta", self.local_rope_theta)
            if not theta > 1.0:
                raise ValueError(f"local_rope_theta={self.local_rope_theta!r} must be > 1")
            object.__setattr__(self, "local_rope_theta", theta)
        elif self.local_rope_scaling is not None:
            raise ValueError("local_rope_scaling needs local_rope_theta (the RoPE base of the sliding layers)")

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is None:
            return
        if isinstance(types, (str, bytes)) or not isinstance(types, (tuple, list)):
            raise ValueError(f"layer_types={types!r} must be None or a tuple of {self.num_layers} layer types "
                             f"({', '.join(LAYER_TYPES)})")
        types = tuple(types)
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries; it must have one per layer ({self.num_layers})")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]={t!r} is not supported; allowed: {', '.join(LAYER_TYPES)}")
        object.__setattr__(self, "layer_types", types)

    def is_sliding(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a ``"sliding_attention"`` layer (its RoPE is the local
        one; its window is :meth:`layer_window`)."""
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` in tokens, or ``None`` for full attention:
        ``sliding_window`` for a ``"sliding_attention"`` layer, ``None`` otherwise.  This and
        :meth:`attention_options` are the only places the per-layer choice is made."""
        return self.sliding_window if self.is_sliding(layer) else None

    def attention_options(self, layer: int | None) -> dict:
        """The keyword options of ``ninfer_kv.ops.paged_attention`` / ``paged_attention_ragged`` for
        decoder layer ``layer`` (``None``: a layer outside the stack, the MTP head's, full attention):
        ``window`` (:meth:`layer_window`), ``soft_cap`` (``attn_soft_cap``) and ``sm_scale``
        (``query_scale``), each only when set, so a plain layer calls the ops exactly as full
        attention does."""
        options = {"window": None if layer is None else self.layer_window(layer),
                   "soft_cap": self.attn_soft_cap, "sm_scale": self.query_scale}
        return {k: v for k, v in options.items() if v is not None}

    def layer_rope(self, layer: int | None) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of decoder layer ``layer``'s RoPE: ``local_rope_theta`` and
        ``local_rope_scaling`` for a sliding layer when ``local_rope_theta`` is set, else
        ``rope_theta`` and ``rope_scaling`` (``None``: the MTP head's layer, the global RoPE)."""
        if layer is not None and self.local_rope_theta is not None and self.is_sliding(layer):
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def jnp_dtype(self):
        """The activation and weight dtype as a JAX dtype."""
        return _DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """The decoder layers kept in window rings: those with a window (:meth:`layer_window`) when
        ``window_rings`` is on and some layer attends to every position; ``()`` otherwise."""
        windowed = tuple(i for i in range(self.num_layers) if self.layer_window(i) is not None)
        if not self.window_rings or len(windowed) == self.num_layers:
            return ()
        return windowed

    def kv_slot(self, layer: int) -> tuple[bool, int]:
        """Where decoder layer ``layer`` keeps its K/V: ``(in_ring, index)``, the layer's index in the
        window rings' stack or in the Main pool's (layers keep their order in each)."""
        rings = self.ring_layers
        if layer in rings:
            return True, rings.index(layer)
        return False, layer - sum(1 for r in rings if r < layer)

    def kv_config(self, profile: "KVProfile | str" = KVProfile.BF16) -> ModelKVConfig:
        """The KV geometry with ``profile`` (input of ``ninfer_kv.plan_kv_cache``): the Main pool's
        layers and, with :attr:`ring_layers`, the window rings (:class:`~ninfer_kv.planning.WindowRings`
        of those layers, ``sliding_window`` and ``ring_step_tokens``)."""
        rings = self.ring_layers
        spec = WindowRings(len(rings), self.sliding_window, self.ring_step_tokens) if rings else None
        return ModelKVConfig(self.num_layers - len(rings), self.num_kv_heads, self.head_dim, KVProfile.parse(profile),
                             rings=spec)

    def main_layout(self, profile: "KVProfile | str" = KVProfile.BF16) -> PagedKVStorageLayout:
        """Main pool layout: one stacked plane per plane kind over the Main layers (every layer but
        :attr:`ring_layers`), page-major."""
        return PagedKVStorageLayout(profile, self.num_layers - len(self.ring_layers), self.num_kv_heads,
                                    self.head_dim)

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
        if self.model.ring_layers and chunk > self.model.ring_step_tokens:
            raise ValueError(f"prefill_chunk={chunk} exceeds the window rings' ring_step_tokens="
                             f"{self.model.ring_step_tokens} (a ring absorbs at most that many tokens per row and step)")
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
    def ring_spec(self):
        """The model's :class:`~ninfer_kv.planning.rings.WindowRings` (``None`` without ring layers)."""
        return self.model.kv_config(self.profile).rings

    @property
    def mtp_layout(self) -> PagedKVStorageLayout:
        return self.model.mtp_layout(self.profile)
