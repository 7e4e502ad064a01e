"""A Hugging Face ``config.json`` mapped onto :class:`~ninfer_kv.models.decoder.config.ModelConfig`.

Families (``architectures[0]``):

=====================  ========  ===============================================================
architecture           family    options
=====================  ========  ===============================================================
``Qwen3ForCausalLM``   qwen3     QK-norm; ``attention_bias`` (q, k, v, o); YaRN for long context
``Qwen2ForCausalLM``   qwen2     q/k/v biases (Qwen2 and Qwen2.5)
``LlamaForCausalLM``   llama     ``attention_bias`` (q, k, v, o), ``mlp_bias``; RoPE ``llama3``, ``linear``
``MistralForCausalLM`` mistral   dense, full attention (``sliding_window`` null or >= the context)
=====================  ========  ===============================================================

Every family may tie its embeddings (``tie_word_embeddings``) and scale RoPE (``rope_scaling`` or
``rope_parameters`` with ``rope_type`` ``linear``, ``llama3`` or ``yarn``).  Missing keys take
transformers' defaults for the family.

What cannot be served is refused, by name with its value, before any weight is read
(:class:`UnsupportedModelError`): another architecture, mixture-of-experts keys, an activation other
than SiLU, partial rotary embeddings, another RoPE type, sliding-window layers whose window is
shorter than the context to serve, and quantized checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..decoder.config import ModelConfig, RopeScaling

__all__ = [
    "CheckpointError",
    "UnsupportedModelError",
    "HFModelInfo",
    "FAMILIES",
    "model_config_from_hf",
]

FAMILIES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
"""Supported ``architectures`` and their family."""

_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM"}
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_ACTIVATIONS = ("silu", "swish")
_SLIDING_DEFAULT = {"mistral": 4096}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file, tensor or option and what is allowed."""


class UnsupportedModelError(CheckpointError):
    """A ``config.json`` option (or architecture) this package cannot serve, named with its value."""


@dataclasses.dataclass(frozen=True)
class HFModelInfo:
    """What ``config.json`` says besides the architecture.

    Attributes:
      family: ``"qwen3"``, ``"qwen2"``, ``"llama"`` or ``"mistral"``.
      architecture: ``architectures[0]``.
      max_position_embeddings: the model's context length.
      max_context: the context the mapping was checked for (sliding windows).
      eos_token_ids: ``eos_token_id`` of ``config.json`` (an int or a list there).
      bos_token_id: ``bos_token_id`` or ``None``.
      checkpoint_dtype: ``torch_dtype`` / ``dtype`` as written, or ``None``.
    """

    family: str
    architecture: str
    max_position_embeddings: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    checkpoint_dtype: str | None


def _refuse(option: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json: {option}={value!r} is not supported: {why}")


def _int(cfg: Mapping, key: str, default: Any = ..., minimum: int = 1) -> int:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise CheckpointError(f"config.json: {key} is missing (an integer >= {minimum} is required)")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise CheckpointError(f"config.json: {key}={v!r} is invalid; it must be an integer >= {minimum}")
    return v


def _float(cfg: Mapping, key: str, default: float) -> float:
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"config.json: {key}={v!r} is invalid; it must be a finite number > 0")
    return float(v)


def _bool(cfg: Mapping, key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise CheckpointError(f"config.json: {key}={v!r} is invalid; it must be true or false")
    return v


def _token_ids(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in items):
        raise CheckpointError(f"{key}={value!r} is invalid; it must be a token id or a list of token ids (integers >= 0)")
    return tuple(items)


def _architecture(cfg: Mapping) -> str:
    archs = cfg.get("architectures")
    if archs is None:
        model_type = cfg.get("model_type")
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        raise _refuse("model_type", model_type, f"no 'architectures' and an unknown model_type; supported: "
                                                 f"{', '.join(FAMILIES)}")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json: architectures={archs!r} is invalid; it must be a list of names")
    if archs[0] not in FAMILIES:
        why = "mixture-of-experts models are not supported" if "moe" in archs[0].lower() or "mixtral" in archs[0].lower() else ""
        raise _refuse("architectures", archs, (why + "; " if why else "") + f"supported: {', '.join(FAMILIES)}")
    return archs[0]


def _rope(cfg: Mapping, head_dim: int, max_pos: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = cfg.get("rope_scaling")
        key = "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"config.json: {key}={params!r} is invalid; it must be an object or null")
    params = dict(params or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise CheckpointError(f"config.json: rope_theta={theta!r} is invalid; it must be a number > 1")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "partial rotary embeddings are not supported (only 1.0)")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3", "yarn"):
        raise _refuse(f"{key}.rope_type", kind, "supported RoPE types: default, linear, llama3, yarn")
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings")
    if kind == "yarn" and factor is None and orig:
        factor = max_pos / orig
    if factor is None:
        raise CheckpointError(f"config.json: {key}.factor is missing (RoPE type {kind!r} needs it)")
    extra: dict[str, Any] = {}
    if kind == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if params.get(name) is None:
                raise CheckpointError(f"config.json: {key}.{name} is missing (RoPE type 'llama3' needs it)")
            extra[name] = params[name]
    if kind == "yarn":
        for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if params.get(name):
                extra[name] = params[name]
        extra["truncate"] = bool(params.get("truncate", True))
    if kind in ("llama3", "yarn") and orig is None:
        raise CheckpointError(f"config.json: {key}.original_max_position_embeddings is missing (RoPE type {kind!r} needs it)")
    try:
        scaling = RopeScaling(kind, factor, original_max_position_embeddings=orig if kind != "linear" else None, **extra)
    except ValueError as exc:
        raise CheckpointError(f"config.json: {key}: {exc}") from None
    return float(theta), scaling


def _check_sliding(cfg: Mapping, family: str, layers: int, max_context: int) -> None:
    """Refuse sliding-window layers whose window is shorter than ``max_context`` (they differ from full attention)."""
    if family == "llama":
        return
    window = cfg.get("sliding_window", _SLIDING_DEFAULT.get(family))
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"config.json: sliding_window={window!r} is invalid; it must be an integer >= 1 or null")
    types = cfg.get("layer_types")
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif family in ("qwen2", "qwen3"):
        start = _int(cfg, "max_window_layers", 28, minimum=0)
        sliding = list(range(start, layers))
    else:
        sliding = list(range(layers))
    if sliding and window < max_context:
        raise _refuse(
            "sliding_window", window,
            f"layers {sliding[0]}..{sliding[-1]} attend to a window shorter than the context max_context={max_context}; "
            f"sliding-window layers are not supported (serve max_context <= {window} to use full attention)",
        )


def model_config_from_hf(
    cfg: Mapping[str, Any], *, dtype: str = "bfloat16", max_context: int | None = None
) -> tuple[ModelConfig, HFModelInfo]:
    """Map a parsed ``config.json`` onto a :class:`ModelConfig`; refuse what cannot be served.

    Args:
      cfg: the parsed ``config.json``.
      dtype: the activation and weight dtype to serve in (``"bfloat16"`` or ``"float32"``).
      max_context: the context that will be served (sliding windows are checked against it);
        default: ``max_position_embeddings``.
    Raises:
      UnsupportedModelError: an architecture or option this package cannot serve, named with its value.
      CheckpointError: a missing or malformed field.
    """
    if not isinstance(cfg, Mapping):
        raise CheckpointError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    arch = _architecture(cfg)
    family = FAMILIES[arch]
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) else None
        raise _refuse("quantization_config.quant_method", method, "quantized checkpoints are not supported")
    for key in _MOE_KEYS:
        if cfg.get(key):
            raise _refuse(key, cfg[key], "mixture-of-experts layers are not supported")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in _ACTIVATIONS:
        raise _refuse("hidden_act", act, "the MLP must be SwiGLU with SiLU (hidden_act silu)")
    d = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    layers = _int(cfg, "num_hidden_layers")
    head_dim = _int(cfg, "head_dim", None) or d // heads
    max_pos = _int(cfg, "max_position_embeddings", 32768 if family.startswith("qwen") else 2048)
    context = max_pos if max_context is None else max_context
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise CheckpointError(f"max_context={max_context!r} is invalid; it must be an integer >= 1")
    theta, scaling = _rope(cfg, head_dim, max_pos)
    _check_sliding(cfg, family, layers, context)
    attention_bias = _bool(cfg, "attention_bias", False)
    options = dict(
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2" or (family in ("qwen3", "llama") and attention_bias),
        o_bias=family in ("qwen3", "llama") and attention_bias,
        mlp_bias=family == "llama" and _bool(cfg, "mlp_bias", False),
    )
    try:
        model = ModelConfig(
            vocab_size=_int(cfg, "vocab_size"),
            d_model=d,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_dim=_int(cfg, "intermediate_size"),
            rope_theta=theta,
            rms_eps=_float(cfg, "rms_norm_eps", 1e-6),
            dtype=dtype,
            tie_embeddings=_bool(cfg, "tie_word_embeddings", False),
            rope_scaling=scaling,
            **options,
        )
    except ValueError as exc:
        raise CheckpointError(f"config.json ({arch}): {exc}") from None
    checkpoint_dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    info = HFModelInfo(
        family=family,
        architecture=arch,
        max_position_embeddings=max_pos,
        max_context=context,
        eos_token_ids=_token_ids(cfg.get("eos_token_id"), "config.json: eos_token_id"),
        bos_token_id=_token_ids(cfg.get("bos_token_id"), "config.json: bos_token_id")[0] if cfg.get("bos_token_id") is not None else None,
        checkpoint_dtype=str(checkpoint_dtype) if checkpoint_dtype is not None else None,
    )
    return model, info
