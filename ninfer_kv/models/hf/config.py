"""A Hugging Face ``config.json`` mapped onto :class:`~ninfer_kv.models.decoder.config.ModelConfig`.

Families (``architectures[0]``, or ``model_type`` when ``architectures`` is absent):

======================  =======  ==================================================================
architecture            family   options
======================  =======  ==================================================================
``Qwen3ForCausalLM``    qwen3    QK-norm; ``attention_bias`` (q, k, v, o); YaRN for long context;
                                 sliding layers with ``use_sliding_window`` (as qwen2)
``Qwen2ForCausalLM``    qwen2    q/k/v biases (Qwen2 and Qwen2.5); with ``use_sliding_window`` the
                                 layers ``i >= max_window_layers`` slide (or ``layer_types``)
``LlamaForCausalLM``    llama    ``attention_bias`` (q, k, v, o), ``mlp_bias``; RoPE ``llama3``, ``linear``
``MistralForCausalLM``  mistral  every layer slides over ``sliding_window`` (default 4096; null: none)
``Gemma2ForCausalLM``   gemma2   (1 + w) RMSNorms, sandwich norms, GELU-tanh MLP, embeddings times
                                 sqrt(hidden_size), tied head, ``query_pre_attn_scalar``,
                                 ``attn_logit_softcapping`` (50) and ``final_logit_softcapping`` (30);
                                 even layers slide (or ``layer_types``)
``Gemma3ForCausalLM``   gemma3   as gemma2 plus (1 + w) QK-norm; no attention soft cap (transformers
                                 ignores ``attn_logit_softcapping`` for Gemma 3); every 6th layer full
                                 (``sliding_window_pattern`` or ``layer_types``); the sliding layers
                                 take their own RoPE (``rope_local_base_freq`` or
                                 ``rope_parameters.sliding_attention``)
======================  =======  ==================================================================

Every family may tie its embeddings (``tie_word_embeddings``) and scale RoPE (``rope_scaling`` or
``rope_parameters`` with ``rope_type`` ``linear``, ``llama3`` or ``yarn``; Gemma 3: per layer type,
``rope_scaling`` applying to the full-attention layers).  Missing keys take transformers' defaults
for the family (``head_dim`` 256, tied embeddings and a 4096 window for Gemma, for instance).

A sliding window at least as long as the context to serve (``max_context``) is full attention and
the mapped config has no window; a shorter one is the sliding layers' window
(:attr:`~ninfer_kv.models.decoder.config.ModelConfig.sliding_window`).

What cannot be served is refused, by name with its value, before any weight is read
(:class:`UnsupportedModelError`): another architecture, mixture-of-experts keys, an activation other
than SiLU (Gemma: GELU-tanh, ``hidden_activation`` ``gelu_pytorch_tanh``), partial rotary
embeddings, another RoPE type, a layer type other than ``sliding_attention`` and
``full_attention``, a Mistral ``layer_types`` naming full-attention layers (transformers slides every
Mistral layer), bidirectional attention (``use_bidirectional_attention``), a Gemma 3
``rope_parameters`` not given per layer type, and quantized checkpoints.

Every value read is type- and range-checked before it is used (:class:`CheckpointError` naming the
key, the value and the allowed range):

* ``num_hidden_layers``: an integer in [1, :data:`MAX_LAYERS`] (4096, the planning layer's bound);
* ``num_attention_heads``, ``num_key_value_heads``: integers in [1, :data:`MAX_HEADS`] (4096);
* ``head_dim`` (given or ``hidden_size // num_attention_heads``): in [1, :data:`MAX_HEAD_DIM`] (4096);
* ``hidden_size``: in [1, :data:`MAX_HIDDEN`] (65536); ``intermediate_size``: in [1, :data:`MAX_INTERMEDIATE`] (2**20);
* ``vocab_size``: in [1, :data:`MAX_VOCAB`] (2**24);
* ``max_position_embeddings``, ``sliding_window``, ``rope_scaling.original_max_position_embeddings``
  and the ``max_context`` argument: in [1, :data:`MAX_POSITIONS`] (2**31 - 64, so positions fit int32);
  ``max_window_layers``: in [0, 4096]; ``sliding_window_pattern``: an integer in [1, 2**31 - 1];
* ``rope_theta`` (and ``rope_local_base_freq``): a finite number in (1, :data:`MAX_ROPE_THETA`] (1e12);
  ``rms_norm_eps``: finite, in (0, 1);
* ``attn_logit_softcapping``, ``final_logit_softcapping``: null or a finite number in
  :data:`SOFT_CAP_RANGE` ([1e-6, 1e6]); ``query_pre_attn_scalar``: a finite number in
  :data:`QUERY_SCALAR_RANGE` ([1e-6, 1e12]);
* the numbers of ``rope_scaling`` (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``beta_fast``,
  ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``): finite, in
  :data:`ROPE_NUMBER_RANGE` ([1e-6, 1e6]; ``mscale`` and ``mscale_all_dim`` may be 0, meaning absent);
  ``rope_type`` a string, ``truncate`` true or false;
* ``eos_token_id``, ``bos_token_id``: an id or a list of ids, each in [0, vocab_size - 1];
* ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``, ``use_sliding_window``,
  ``use_bidirectional_attention``: true or false;
* ``layer_types``: a list of ``num_hidden_layers`` strings, each ``sliding_attention`` or
  ``full_attention``; ``torch_dtype`` / ``dtype``: a string.

The integer bounds keep every product of them (``num_attention_heads * head_dim``, token ids,
positions) inside int32 and far above any published model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ...schema.integers import check_int
from ...planning.bounds import MAX_CONTEXT as _MAX_CONTEXT
from ...planning.bounds import MAX_LAYERS as _MAX_LAYERS
from ..decoder.config import FULL, LAYER_TYPES, SLIDING, ModelConfig, RopeScaling

__all__ = [
    "CheckpointError",
    "UnsupportedModelError",
    "HFModelInfo",
    "FAMILIES",
    "model_config_from_hf",
    "MAX_LAYERS",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_HIDDEN",
    "MAX_INTERMEDIATE",
    "MAX_VOCAB",
    "MAX_POSITIONS",
    "MAX_ROPE_THETA",
    "ROPE_NUMBER_RANGE",
    "SOFT_CAP_RANGE",
    "QUERY_SCALAR_RANGE",
]

FAMILIES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
"""Supported ``architectures`` and their family."""

MAX_LAYERS = _MAX_LAYERS
"""Most ``num_hidden_layers`` (the planning layer's bound on layers one pool stacks)."""

MAX_HEADS = 4096
"""Most ``num_attention_heads`` (and ``num_key_value_heads``)."""

MAX_HEAD_DIM = 4096
"""Largest ``head_dim`` (with :data:`MAX_HEADS`, ``heads * head_dim`` stays below 2**24)."""

MAX_HIDDEN = 65536
"""Largest ``hidden_size``."""

MAX_INTERMEDIATE = 2**20
"""Largest ``intermediate_size``."""

MAX_VOCAB = 2**24
"""Largest ``vocab_size`` (token ids fit int32 with room to spare)."""

MAX_POSITIONS = _MAX_CONTEXT
"""Largest ``max_position_embeddings``, ``original_max_position_embeddings``, ``sliding_window`` and
``max_context``: the planning layer's bound, so every position fits int32."""

MAX_ROPE_THETA = 1e12
"""Largest ``rope_theta``."""

ROPE_NUMBER_RANGE = (1e-6, 1e6)
"""The range of every number of ``rope_scaling`` (``factor``, ``beta_fast``, ...)."""

SOFT_CAP_RANGE = (1e-6, 1e6)
"""The range of ``attn_logit_softcapping`` and ``final_logit_softcapping`` (inclusive; null: none)."""

QUERY_SCALAR_RANGE = (1e-6, 1e12)
"""The range of ``query_pre_attn_scalar`` (inclusive): the attention scale is its ``-0.5`` power."""

_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_ACTIVATIONS = ("silu", "swish")
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
_GEMMA = ("gemma2", "gemma3")
_SLIDING_DEFAULT = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma2": 4096, "gemma3": 4096}
_SOFT_CAP_DEFAULTS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}  # (attention, final) when the key is absent
_MAX_POSITIONS_DEFAULT = {"qwen3": 32768, "qwen2": 32768, "gemma2": 8192, "gemma3": 131072}
_GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' Gemma3TextConfig.default_theta
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                 "mscale", "mscale_all_dim")
_ZERO_MEANS_ABSENT = ("mscale", "mscale_all_dim")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file, tensor or option and what is allowed."""


class UnsupportedModelError(CheckpointError):
    """A ``config.json`` option (or architecture) this package cannot serve, named with its value."""


@dataclasses.dataclass(frozen=True)
class HFModelInfo:
    """What ``config.json`` says besides the architecture.

    Attributes:
      family: ``"qwen3"``, ``"qwen2"``, ``"llama"``, ``"mistral"``, ``"gemma2"`` or ``"gemma3"``.
      architecture: ``architectures[0]``.
      max_position_embeddings: the model's context length.
      max_context: the context the mapping was checked for (sliding windows).
      eos_token_ids: ``eos_token_id`` of ``config.json`` (an int or a list there), each ``< vocab_size``.
        The stop tokens to serve with are :attr:`~ninfer_kv.models.hf.checkpoint.LoadedModel.eos_token_ids`
        (``generation_config.json`` first).
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


def _show(value: Any, n: int = 80) -> str:
    """``repr(value)``, cut to ``n`` characters."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _refuse(option: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json: {option}={_show(value)} is not supported: {why}")


def _invalid(key: str, value: Any, allowed: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key}={_show(value)} is invalid; it must be {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_int(key: str, v: Any, minimum: int, maximum: int) -> int:
    """``v`` as an ``int`` if it is an integer in ``[minimum, maximum]``, else a :class:`CheckpointError`
    naming ``key`` (:func:`~ninfer_kv.schema.integers.check_int`)."""
    return check_int(key, v, minimum, maximum, error=_invalid)


def _int(cfg: Mapping, key: str, default: Any = ..., minimum: int = 1, maximum: int = 2**31 - 1) -> int:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise CheckpointError(f"config.json: {key} is missing (an integer in [{minimum}, {maximum}] is required)")
        return default
    return _check_int(key, cfg[key], minimum, maximum)


def _float(cfg: Mapping, key: str, default: float, lo: float, hi: float) -> float:
    """A finite number in the open interval ``(lo, hi)``; missing or null gives ``default``."""
    v = cfg.get(key, default)
    if v is None:
        v = default
    if not _is_number(v) or not lo < v < hi:
        raise _invalid(key, v, f"a finite number in ({lo}, {hi})")
    return float(v)


def _bool(cfg: Mapping, key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _invalid(key, v, "true or false")
    return v


def token_ids(value: Any, where: str, vocab_size: int | None) -> tuple[int, ...]:
    """``value`` (a token id, a list of ids, or null) as a tuple; each id an integer in ``[0, vocab_size - 1]``.

    ``where`` names the file and key in the error (``"config.json: eos_token_id"``).
    """
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    top = (vocab_size - 1) if vocab_size is not None else 2**31 - 1
    allowed = f"a token id or a list of token ids, integers in [0, {top}]" + (
        f" (vocab_size={vocab_size})" if vocab_size is not None else "")
    for x in items:
        if not _is_int(x):
            raise CheckpointError(f"{where}={_show(value)} is invalid; it must be {allowed}")
        if not 0 <= x <= top:
            raise CheckpointError(f"{where}={_show(value)} holds id {x} outside the vocabulary; ids must be in [0, {top}]"
                                  + (f" (vocab_size={vocab_size})" if vocab_size is not None else ""))
    return tuple(items)


def _architecture(cfg: Mapping) -> str:
    archs = cfg.get("architectures")
    if archs is None:
        model_type = cfg.get("model_type")
        if isinstance(model_type, str) and model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        raise _refuse("model_type", model_type, f"no 'architectures' and an unknown model_type; supported: "
                                                 f"{', '.join(FAMILIES)}")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise _invalid("architectures", archs, "a list of names")
    if archs[0] not in FAMILIES:
        why = "mixture-of-experts models are not supported" if "moe" in archs[0].lower() or "mixtral" in archs[0].lower() else ""
        raise _refuse("architectures", archs, (why + "; " if why else "") + f"supported: {', '.join(FAMILIES)}")
    return archs[0]


def _rope_numbers(params: Mapping, key: str) -> dict[str, Any]:
    """The known ``rope_scaling`` fields, each type- and range-checked (absent or null: ``None``)."""
    lo, hi = ROPE_NUMBER_RANGE
    out: dict[str, Any] = {}
    for name in _ROPE_NUMBERS:
        v = params.get(name)
        if v is not None and not (_is_number(v) and (lo <= v <= hi or (v == 0 and name in _ZERO_MEANS_ABSENT))):
            allowed = f"a finite number in [{lo}, {hi}]" + (" or 0" if name in _ZERO_MEANS_ABSENT else "")
            raise _invalid(f"{key}.{name}", v, allowed)
        out[name] = v
    orig = params.get("original_max_position_embeddings")
    if orig is not None:
        _check_int(f"{key}.original_max_position_embeddings", orig, 1, MAX_POSITIONS)
    out["original_max_position_embeddings"] = orig
    truncate = params.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise _invalid(f"{key}.truncate", truncate, "true or false")
    out["truncate"] = True if truncate is None else truncate
    return out


def _theta(value: Any, key: str, default: float) -> float:
    """A RoPE base: ``default`` for null, else a finite number in ``(1, MAX_ROPE_THETA]`` named ``key``."""
    if value is None:
        return default
    if not _is_number(value) or not 1 < value <= MAX_ROPE_THETA:
        raise _invalid(key, value, f"a finite number in (1, {MAX_ROPE_THETA:g}]")
    return float(value)


def _rope(cfg: Mapping, head_dim: int, max_pos: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = cfg.get("rope_scaling")
        key = "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise _invalid(key, params, "an object or null")
    params = dict(params or {})
    if params.get("rope_theta") is not None:
        theta = _theta(params["rope_theta"], f"{key}.rope_theta", 10000.0)
    else:
        theta = _theta(cfg.get("rope_theta"), "rope_theta", 10000.0)
    return theta, _rope_scaling(cfg, params, key, max_pos)


def _rope_scaling(cfg: Mapping, params: Mapping, key: str, max_pos: int) -> RopeScaling | None:
    """The RoPE scaling of one RoPE parameter object ``params`` (named ``key`` in errors)."""
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and not _is_number(partial):
        raise _invalid("partial_rotary_factor", partial, "a finite number (only 1.0 is supported)")
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "partial rotary embeddings are not supported (only 1.0)")
    kind = params.get("rope_type", params.get("type")) or "default"
    if not isinstance(kind, str):
        raise _invalid(f"{key}.rope_type", kind, "a string (default, linear, llama3 or yarn)")
    fields = _rope_numbers(params, key)
    if kind == "default":
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise _refuse(f"{key}.rope_type", kind, "supported RoPE types: default, linear, llama3, yarn")
    factor = fields["factor"]
    orig = fields["original_max_position_embeddings"]
    if kind == "yarn" and factor is None and orig:
        factor = max_pos / orig
    if factor is None:
        raise CheckpointError(f"config.json: {key}.factor is missing (RoPE type {kind!r} needs it)")
    extra: dict[str, Any] = {}
    if kind == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if fields[name] is None:
                raise CheckpointError(f"config.json: {key}.{name} is missing (RoPE type 'llama3' needs it)")
            extra[name] = fields[name]
    if kind == "yarn":
        for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if fields[name]:
                extra[name] = fields[name]
        extra["truncate"] = fields["truncate"]
    if kind in ("llama3", "yarn") and orig is None:
        raise CheckpointError(f"config.json: {key}.original_max_position_embeddings is missing (RoPE type {kind!r} needs it)")
    try:
        return RopeScaling(kind, factor, original_max_position_embeddings=orig if kind != "linear" else None, **extra)
    except ValueError as exc:
        raise CheckpointError(f"config.json: {key}: {exc}") from None


def _gemma3_rope(cfg: Mapping, max_pos: int) -> tuple[tuple[float, RopeScaling | None], tuple[float, RopeScaling | None]]:
    """``((theta, scaling) of the full-attention layers, (theta, scaling) of the sliding layers)`` of a
    Gemma 3 config, as transformers' ``Gemma3TextConfig.convert_rope_params_to_dict`` builds them:
    ``rope_parameters`` per layer type (transformers 5), or ``rope_theta`` (default 1e6) with
    ``rope_scaling`` for the full-attention layers and ``rope_local_base_freq`` (default 1e4) for the
    sliding ones; ``rope_scaling`` also updates a given ``rope_parameters.full_attention``."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _invalid("rope_parameters", params, "an object with 'sliding_attention' and 'full_attention' entries, "
                                                      "or null")
        flat = [k for k in params if k not in LAYER_TYPES]
        if flat:
            raise _refuse("rope_parameters", params, "Gemma 3 takes RoPE parameters per layer type: an object whose "
                                                     "keys are 'sliding_attention' and 'full_attention'")
    params = dict(params or {})
    out = {}
    for layer_type, legacy in ((FULL, "rope_theta"), (SLIDING, "rope_local_base_freq")):
        key = f"rope_parameters.{layer_type}"
        entry = params.get(layer_type)
        if entry is not None and not isinstance(entry, dict):
            raise _invalid(key, entry, "an object or null")
        entry = dict(entry or {"rope_type": "default"})
        theta_key = f"{key}.rope_theta"
        scaling = cfg.get("rope_scaling") if layer_type == FULL else None
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise _invalid("rope_scaling", scaling, "an object or null")
            entry.update(scaling)
            key = "rope_scaling"
            theta_key = "rope_scaling.rope_theta" if scaling.get("rope_theta") is not None else theta_key
        if entry.get("rope_theta") is not None:
            theta = _theta(entry["rope_theta"], theta_key, _GEMMA3_THETA[layer_type])
        else:
            theta = _theta(cfg.get(legacy), legacy, _GEMMA3_THETA[layer_type])
        out[layer_type] = (theta, _rope_scaling(cfg, entry, key, max_pos))
    return out[FULL], out[SLIDING]


def _soft_cap(cfg: Mapping, key: str, default: float | None) -> float | None:
    """``key`` as a soft cap: absent gives ``default``, null gives ``None``, else a finite number in
    :data:`SOFT_CAP_RANGE`."""
    if key not in cfg:
        return default
    v = cfg[key]
    if v is None:
        return None
    lo, hi = SOFT_CAP_RANGE
    if not _is_number(v) or not lo <= v <= hi:
        raise _invalid(key, v, f"null or a finite number in [{lo}, {hi}]")
    return float(v)


def _layer_types(cfg: Mapping, family: str, layers: int, window: int | None) -> list[str]:
    """Each layer's type as transformers derives it: ``layer_types`` when given (a list of
    ``layers`` strings from :data:`~ninfer_kv.models.decoder.config.LAYER_TYPES`), else the family's
    rule: Gemma 2 slides the even layers (``(i + 1) % 2``), Gemma 3 every layer but each
    ``sliding_window_pattern``-th (default 6), Qwen2/Qwen3 the layers ``i >= max_window_layers``
    (default 28) when a window is on, Mistral every layer, Llama none."""
    types = cfg.get("layer_types")
    if types is not None and family != "llama":
        if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
            raise _invalid("layer_types", types, f"a list of {layers} strings (one per layer)")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise _refuse(f"layer_types[{i}]", t, f"supported layer types: {', '.join(LAYER_TYPES)}")
        return list(types)
    if family == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if family == "gemma3":
        pattern = cfg.get("sliding_window_pattern", 6)
        _check_int("sliding_window_pattern", pattern, 1, 2**31 - 1)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if family in ("qwen2", "qwen3"):
        start = _int(cfg, "max_window_layers", 28, minimum=0, maximum=MAX_LAYERS)
        return [SLIDING if window is not None and i >= start else FULL for i in range(layers)]
    if family == "mistral":
        return [SLIDING] * layers
    return [FULL] * layers


def _sliding(cfg: Mapping, family: str, layers: int, max_context: int) -> tuple[list[str], int | None]:
    """``(layer types, window)``: the window is ``None`` when no layer attends to fewer than
    ``max_context`` positions (no window, or one at least the context)."""
    window = None
    if family != "llama":
        window = cfg.get("sliding_window", _SLIDING_DEFAULT.get(family))
        if family in ("qwen2", "qwen3") and not _bool(cfg, "use_sliding_window", False):
            window = None
    if window is not None:
        _check_int("sliding_window", window, 1, MAX_POSITIONS)
    types = _layer_types(cfg, family, layers, window)
    if window is not None and window >= max_context:
        window = None  # q - k < window for every pair of positions below the context: full attention
    if family == "mistral" and window is not None and FULL in types:
        raise _refuse("layer_types", types, "MistralForCausalLM slides every layer over sliding_window (transformers "
                                            "ignores layer_types for Mistral); alternating layers are not supported")
    return types, window


def model_config_from_hf(
    cfg: Mapping[str, Any], *, dtype: str = "bfloat16", max_context: int | None = None
) -> tuple[ModelConfig, HFModelInfo]:
    """Map a parsed ``config.json`` onto a :class:`ModelConfig`; refuse what cannot be served.

    Args:
      cfg: the parsed ``config.json``.
      dtype: the activation and weight dtype to serve in (``"bfloat16"`` or ``"float32"``).
      max_context: the context that will be served (a sliding window at least this long is full
        attention); default: ``max_position_embeddings``.
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
    gemma = family in _GEMMA
    if gemma:
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        if not isinstance(act, str) or act not in _GEMMA_ACTIVATIONS:
            raise _refuse("hidden_activation", act, "the MLP must be GELU with the tanh approximation "
                                                    "(hidden_activation gelu_pytorch_tanh)")
        if _bool(cfg, "use_bidirectional_attention", False):
            raise _refuse("use_bidirectional_attention", True, "only causal attention is served")
    else:
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if not isinstance(act, str) or act not in _ACTIVATIONS:
            raise _refuse("hidden_act", act, "the MLP must be SwiGLU with SiLU (hidden_act silu)")
    vocab = _int(cfg, "vocab_size", maximum=MAX_VOCAB)
    d = _int(cfg, "hidden_size", maximum=MAX_HIDDEN)
    heads = _int(cfg, "num_attention_heads", maximum=MAX_HEADS)
    kv_heads = _int(cfg, "num_key_value_heads", heads, maximum=MAX_HEADS)
    layers = _int(cfg, "num_hidden_layers", maximum=MAX_LAYERS)
    mlp = _int(cfg, "intermediate_size", maximum=MAX_INTERMEDIATE)
    head_dim = _int(cfg, "head_dim", 256 if gemma else None, maximum=MAX_HEAD_DIM) or d // heads
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _invalid("head_dim", head_dim, f"an integer in [1, {MAX_HEAD_DIM}] (hidden_size // num_attention_heads "
                                             f"when absent)")
    max_pos = _int(cfg, "max_position_embeddings", _MAX_POSITIONS_DEFAULT.get(family, 2048), maximum=MAX_POSITIONS)
    context = max_pos if max_context is None else max_context
    if not _is_int(context) or not 1 <= context <= MAX_POSITIONS:
        raise CheckpointError(f"max_context={_show(max_context)} is invalid; it must be an integer in [1, {MAX_POSITIONS}]")
    local_theta = local_scaling = None
    if family == "gemma3":
        (theta, scaling), (local_theta, local_scaling) = _gemma3_rope(cfg, max_pos)
    else:
        theta, scaling = _rope(cfg, head_dim, max_pos)
    types, window = _sliding(cfg, family, layers, context)
    if SLIDING not in types:
        window = None
    keep_types = SLIDING in types and (window is not None or local_theta is not None)
    attention_bias = _bool(cfg, "attention_bias", False)
    options = dict(
        qk_norm=family in ("qwen3", "gemma3"),
        qkv_bias=family == "qwen2" or (family != "mistral" and attention_bias),
        o_bias=family not in ("qwen2", "mistral") and attention_bias,
        mlp_bias=family == "llama" and _bool(cfg, "mlp_bias", False),
        layer_types=tuple(types) if keep_types else None,
        sliding_window=window,
    )
    if gemma:
        attn_cap, final_cap = _SOFT_CAP_DEFAULTS[family]
        attn_cap = _soft_cap(cfg, "attn_logit_softcapping", attn_cap)
        if family == "gemma3":
            attn_cap = None  # validated, but transformers' Gemma 3 attention never applies it
        scalar = cfg.get("query_pre_attn_scalar", 256)
        lo, hi = QUERY_SCALAR_RANGE
        if not _is_number(scalar) or not lo <= scalar <= hi:
            raise _invalid("query_pre_attn_scalar", scalar, f"a finite number in [{lo}, {hi}]")
        options.update(attn_soft_cap=attn_cap, final_soft_cap=_soft_cap(cfg, "final_logit_softcapping", final_cap),
                       query_scale=float(scalar) ** -0.5, gemma_norms=True, sandwich_norms=True,
                       mlp_activation="gelu_tanh", embed_scale=True, local_rope_theta=local_theta,
                       local_rope_scaling=local_scaling)
    eps = _float(cfg, "rms_norm_eps", 1e-6, 0.0, 1.0)
    tie = _bool(cfg, "tie_word_embeddings", gemma)
    eos = token_ids(cfg.get("eos_token_id"), "config.json: eos_token_id", vocab)
    bos = token_ids(cfg.get("bos_token_id"), "config.json: bos_token_id", vocab)
    checkpoint_dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if checkpoint_dtype is not None and not isinstance(checkpoint_dtype, str):
        raise _invalid("torch_dtype", checkpoint_dtype, "a string such as 'bfloat16', or null")
    try:
        model = ModelConfig(
            vocab_size=vocab,
            d_model=d,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_dim=mlp,
            rope_theta=theta,
            rms_eps=eps,
            dtype=dtype,
            tie_embeddings=tie,
            rope_scaling=scaling,
            **options,
        )
    except ValueError as exc:
        raise CheckpointError(f"config.json ({arch}): {exc}") from None
    info = HFModelInfo(
        family=family,
        architecture=arch,
        max_position_embeddings=max_pos,
        max_context=context,
        eos_token_ids=eos,
        bos_token_id=bos[0] if bos else None,
        checkpoint_dtype=checkpoint_dtype,
    )
    return model, info
