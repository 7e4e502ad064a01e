"""Hugging Face checkpoint directories: load into the decoder's parameter tree, and write.

A directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).  Loading runs in stages,
and nothing is built until every check passed:

1. ``config.json`` is read (a regular file of at most
   :data:`~ninfer_kv.models.hf.bounded_files.MAX_CONFIG_BYTES`, strict UTF-8, nesting bounded) and
   mapped (:func:`~ninfer_kv.models.hf.config.model_config_from_hf`): an option that cannot be served
   is refused before any tensor is looked at; the stop tokens are resolved
   (``generation_config.json``'s ``eos_token_id`` when it names one, else ``config.json``'s; every id
   below ``vocab_size``);
2. every shard's header is read and validated (:func:`~ninfer_kv.models.hf.safetensors_io.read_header`:
   offsets inside the file, so a truncated file is named with the first tensor it cuts);
3. the inventory is checked against the configuration: first the number of tensors the headers hold
   against the number the config expects (the first missing name found lazily, so nothing
   proportional to the config is built before the files back it), then every expected tensor present
   (in the shard the index names), with the expected shape and a float dtype (BF16, F16, F32), no
   unexpected tensor (``rotary_emb.inv_freq`` buffers and, with tied embeddings, ``lm_head.weight``
   are ignored);
4. each shard is opened once, its tensors are read into fresh process memory
   (:func:`~ninfer_kv.models.hf.safetensors_io.read_tensors`), the shard is closed, and each tensor is
   put on the device and cast to the configured dtype.  No parameter aliases a file: the files may
   be rewritten, truncated or deleted once :func:`load_checkpoint` returns, and no descriptor stays open.

Any failure raises a :class:`~ninfer_kv.models.hf.config.CheckpointError` naming the file, tensor or
option; no partial parameter tree is ever returned.

Tensor names are transformers' (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
...; with Gemma's sandwich norms ``post_attention_layernorm`` is the attention output's norm and
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` the MLP's, :func:`layer_tensor_names`).  Projections keep transformers' ``(out, in)`` orientation in the decoder, so loading is a copy,
never a transpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np

from ..decoder.config import ModelConfig
from ..decoder.weights import init_params, layer_param_shapes
from .bounded_files import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, load_json
from .config import CheckpointError, HFModelInfo, model_config_from_hf
from .safetensors_io import TensorInfo, read_header, read_tensors, write_safetensors
from .tokenizer import eos_token_ids

__all__ = [
    "LoadedModel",
    "CheckpointPlan",
    "SINGLE_FILE",
    "INDEX_FILE",
    "CONFIG_FILE",
    "read_config",
    "plan_checkpoint",
    "load_checkpoint",
    "expected_tensors",
    "iter_expected_tensors",
    "expected_tensor_count",
    "checkpoint_tensors",
    "hf_config_dict",
    "save_checkpoint",
    "save_random_checkpoint",
    "layer_tensor_names",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_FLOAT_DTYPES = ("BF16", "F16", "F32")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "wk": "self_attn.k_proj.weight",
    "bk": "self_attn.k_proj.bias",
    "wv": "self_attn.v_proj.weight",
    "bv": "self_attn.v_proj.bias",
    "wo": "self_attn.o_proj.weight",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "b_gate": "mlp.gate_proj.bias",
    "w_up": "mlp.up_proj.weight",
    "b_up": "mlp.up_proj.bias",
    "w_down": "mlp.down_proj.weight",
    "b_down": "mlp.down_proj.bias",
}

_SANDWICH_NAMES = {
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
"""With sandwich norms (Gemma 2 and 3) ``post_attention_layernorm`` is the attention output's norm and
``pre_feedforward_layernorm`` the MLP input's (which is ``post_attention_layernorm`` in the other families)."""


def layer_tensor_names(config: ModelConfig) -> dict[str, str]:
    """Parameter key of a layer -> transformers' tensor name under ``model.layers.{i}.``."""
    return {**_LAYER_NAMES, **_SANDWICH_NAMES} if config.sandwich_norms else dict(_LAYER_NAMES)


def iter_expected_tensors(config: ModelConfig) -> Iterator[tuple[str, tuple, tuple[int, ...]]]:
    """``(transformers name, location in the parameter tree, shape)`` of every tensor ``config`` needs,
    lazily, in a fixed order (embedding, final norm, LM head, then layer by layer).

    A location is a key path: ``("embed",)``, ``("layers", 3, "wq")``, ...
    """
    yield "model.embed_tokens.weight", ("embed",), (config.vocab_size, config.d_model)
    yield "model.norm.weight", ("final_norm",), (config.d_model,)
    if not config.tie_embeddings:
        yield "lm_head.weight", ("lm_head",), (config.vocab_size, config.d_model)
    shapes = layer_param_shapes(config)
    names = layer_tensor_names(config)
    for i in range(config.num_layers):
        for key, shape in shapes.items():
            yield f"model.layers.{i}.{names[key]}", ("layers", i, key), shape


def expected_tensor_count(config: ModelConfig) -> int:
    """How many tensors :func:`iter_expected_tensors` yields, computed without listing them."""
    return 2 + (not config.tie_embeddings) + config.num_layers * len(layer_param_shapes(config))


def expected_tensors(config: ModelConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """transformers tensor name -> (location in the parameter tree, shape) for ``config``
    (:func:`iter_expected_tensors` as a dict)."""
    return {name: (where, shape) for name, where, shape in iter_expected_tensors(config)}


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_embeddings and name == "lm_head.weight"


def read_config(directory: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of a checkpoint directory (``CheckpointError`` naming the problem).

    The file must be a regular file of at most :data:`~ninfer_kv.models.hf.bounded_files.MAX_CONFIG_BYTES`
    bytes of UTF-8 JSON nested at most :data:`~ninfer_kv.models.hf.bounded_files.MAX_JSON_DEPTH` deep.
    """
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: not a directory (a Hugging Face checkpoint directory with config.json)")
    path = Path(directory) / CONFIG_FILE
    cfg = load_json(path, MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _short(value: Any, n: int = 100) -> str:
    """``repr(value)``, cut to ``n`` characters (names in an index can be long)."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _shard_name_problem(name: str) -> str | None:
    if not name or name in (".", "..") or "/" in name or "\0" in name or Path(name).name != name:
        return "must be a file name inside the checkpoint directory"
    return None


def _shard_files(directory: Path) -> tuple[dict[str, str] | None, list[Path]]:
    """``(weight_map or None, shard paths)``; the index wins when both forms are present."""
    index = directory / INDEX_FILE
    if os.path.lexists(index):
        doc = load_json(index, MAX_INDEX_BYTES)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must be an object mapping tensor names to shard file names")
        files = set()
        for name, f in weight_map.items():
            if not isinstance(f, str):
                raise CheckpointError(f"{index}: weight_map[{_short(name)}]={_short(f)} must be a shard file name (a string)")
            files.add(f)
        for f in sorted(files):
            problem = _shard_name_problem(f)
            if problem:
                raise CheckpointError(f"{index}: shard {_short(f)} {problem}")
            if not os.path.lexists(directory / f):
                raise CheckpointError(f"{index}: shard {_short(f)} does not exist in {directory}")
        return weight_map, [directory / f for f in sorted(files)]
    single = directory / SINGLE_FILE
    if os.path.lexists(single):
        return None, [single]
    raise CheckpointError(f"{directory}: has neither {SINGLE_FILE} nor {INDEX_FILE}")


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """A checkpoint checked and ready to load (nothing read beyond the headers).

    Attributes:
      directory: the checkpoint directory.
      config: the mapped :class:`ModelConfig`.
      info: the rest of ``config.json`` (:class:`~ninfer_kv.models.hf.config.HFModelInfo`).
      tensors: transformers name -> (tree location, the tensor's table entry) of every tensor to load.
      ignored: names present in the files and not used.
      eos_token_ids: the stop tokens (``generation_config.json``'s ``eos_token_id`` when it names one,
        else ``config.json``'s), each below ``config.vocab_size``.
    """

    directory: Path
    config: ModelConfig
    info: HFModelInfo
    tensors: Mapping[str, tuple[tuple, TensorInfo]]
    ignored: tuple[str, ...]
    eos_token_ids: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the load reads."""
        return sum(t.nbytes for _, t in self.tensors.values())


def _missing(name: str, shape: tuple, model: ModelConfig, info: HFModelInfo, weight_map: Mapping | None) -> CheckpointError:
    if weight_map is not None and name in weight_map:
        return CheckpointError(f"tensor {name!r}: {INDEX_FILE} names shard {weight_map[name]!r}, which does not hold it")
    return CheckpointError(
        f"tensor {name!r} is missing from the checkpoint ({info.architecture}, {model.num_layers} layers, "
        f"shape {shape} expected)"
    )


def plan_checkpoint(
    directory: str | os.PathLike, *, dtype: str = "bfloat16", max_context: int | None = None
) -> CheckpointPlan:
    """Stages 1-3 of a load (module docstring): map the config, read the headers, check the inventory."""
    directory = Path(directory)
    model, info = model_config_from_hf(read_config(directory), dtype=dtype, max_context=max_context)
    eos = eos_token_ids(directory, info.eos_token_ids, model.vocab_size)
    weight_map, files = _shard_files(directory)
    found: dict[str, TensorInfo] = {}
    for path in files:
        header = read_header(path)
        for name, t in header.tensors.items():
            if weight_map is not None and weight_map.get(name) not in (None, path.name):
                continue  # the index names another shard for it
            if name in found:
                raise CheckpointError(f"tensor {_short(name, 200)} is in both {found[name].path.name} and {path.name}")
            found[name] = t
    usable = sum(1 for name in found if not _ignored(name, model))
    if expected_tensor_count(model) > usable:  # some expected tensor is absent: name the first, lazily
        for name, _, shape in iter_expected_tensors(model):
            if name not in found:
                raise _missing(name, shape, model, info, weight_map)
    expected = expected_tensors(model)  # no longer than the headers' inventory
    tensors: dict[str, tuple[tuple, TensorInfo]] = {}
    for name, (where, shape) in expected.items():
        t = found.get(name)
        if t is None:
            raise _missing(name, shape, model, info, weight_map)
        if t.shape != shape:
            raise CheckpointError(f"tensor {name!r} in {t.path.name} has shape {t.shape}; the config needs {shape}")
        if t.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {t.path.name} has dtype {t.dtype}; allowed: {', '.join(_FLOAT_DTYPES)}")
        tensors[name] = (where, t)
    ignored = []
    for name in found:
        if name in expected:
            continue
        if not _ignored(name, model):
            raise CheckpointError(
                f"unexpected tensor {_short(name, 200)} in {found[name].path.name}: the {info.architecture} config "
                f"(qk_norm={model.qk_norm}, qkv_bias={model.qkv_bias}, o_bias={model.o_bias}, mlp_bias={model.mlp_bias}, "
                f"tie_embeddings={model.tie_embeddings}, sandwich_norms={model.sandwich_norms}, {model.num_layers} layers) "
                f"has no such parameter"
            )
        ignored.append(name)
    return CheckpointPlan(directory, model, info, tensors, tuple(sorted(ignored)), eos)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A loaded checkpoint.

    Attributes:
      directory: where it was loaded from.
      config: the decoder configuration.
      info: the rest of ``config.json``.
      params: the parameter tree (device arrays in ``config.dtype``, in process-owned memory: none
        aliases a file).
      bytes_read: tensor bytes copied from the files.
      load_seconds: wall time of the whole load (config, headers, copies).
      eos_token_ids: the stop tokens: ``generation_config.json``'s ``eos_token_id`` when it names one,
        else ``config.json``'s; each below ``config.vocab_size``.
    """

    directory: Path
    config: ModelConfig
    info: HFModelInfo
    params: dict
    bytes_read: int
    load_seconds: float
    eos_token_ids: tuple[int, ...] = ()


def _set(tree: dict, where: tuple, value) -> None:
    if where[0] == "layers":
        tree["layers"][where[1]][where[2]] = value
    else:
        tree[where[0]] = value


def load_checkpoint(
    directory: str | os.PathLike, *, dtype: str = "bfloat16", max_context: int | None = None
) -> LoadedModel:
    """Load a Hugging Face checkpoint directory (see the module docstring).

    Each shard is opened once and closed before the next; tensors are read into fresh host buffers,
    then put on the device, so the returned parameters never alias the files.

    Args:
      directory: the checkpoint directory.
      dtype: the dtype to serve in (``"bfloat16"`` or ``"float32"``); BF16, F16 and F32 tensors are cast to it.
      max_context: the context to be served (checked against sliding windows; default the model's).
    """
    start = time.perf_counter()
    plan = plan_checkpoint(directory, dtype=dtype, max_context=max_context)
    target = plan.config.jnp_dtype
    tree: dict[str, Any] = {"layers": tuple({} for _ in range(plan.config.num_layers))}
    cast = jax.jit(lambda x: x.astype(target))
    by_file: dict[Path, list[tuple[tuple, TensorInfo]]] = {}
    for where, info in plan.tensors.values():
        by_file.setdefault(info.path, []).append((where, info))
    for path, items in by_file.items():
        where_of = {info.name: where for where, info in items}
        with contextlib.closing(read_tensors(path, [info for _, info in items])) as reader:
            for info, host in reader:
                arr = jax.device_put(host)
                if arr.dtype != target:
                    arr = cast(arr)
                _set(tree, where_of[info.name], arr)
    jax.block_until_ready(tree)
    return LoadedModel(plan.directory, plan.config, plan.info, tree, plan.nbytes, time.perf_counter() - start,
                       plan.eos_token_ids)


# -- writing -------------------------------------------------------------------------------------------


def checkpoint_tensors(params: dict, config: ModelConfig, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """The parameter tree as transformers-named numpy arrays in ``dtype`` (``bfloat16``, ``float16``, ``float32``)."""
    np_dtype = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                "float32": np.dtype(np.float32)}.get(dtype)
    if np_dtype is None:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: bfloat16, float16, float32")
    out = {}
    for name, (where, shape) in expected_tensors(config).items():
        node: Any = params
        for k in where:
            node = node[k]
        a = np.asarray(jax.device_get(node))
        if a.shape != shape:
            raise ValueError(f"parameter {'/'.join(map(str, where))} has shape {a.shape}; {name} needs {shape}")
        out[name] = a.astype(np_dtype)
    return out


_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                  "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPE = {"gemma3": "gemma3_text"}


def _rope_scaling_dict(rs) -> dict[str, Any]:
    scaling: dict[str, Any] = {"rope_type": rs.kind, "factor": rs.factor}
    if rs.kind in ("llama3", "yarn"):
        scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
    if rs.kind == "llama3":
        scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    if rs.kind == "yarn":
        scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)
        if rs.attention_factor is not None:
            scaling["attention_factor"] = rs.attention_factor
    return scaling


def _check_expressible(config: ModelConfig, family: str) -> None:
    """``ValueError`` naming the first option of ``config`` that ``family``'s ``config.json`` cannot say."""
    gemma = family in ("gemma2", "gemma3")
    want_qk = family in ("qwen3", "gemma3")
    if config.qk_norm != want_qk:
        raise ValueError(f"qk_norm={config.qk_norm} cannot be expressed in family {family!r} (it has qk_norm={want_qk})")
    if family == "qwen2" and (not config.qkv_bias or config.o_bias):
        raise ValueError("family 'qwen2' has q/k/v biases and no output bias (qkv_bias=True, o_bias=False)")
    if family in ("qwen3", "llama", "gemma2", "gemma3") and config.qkv_bias != config.o_bias:
        raise ValueError(f"family {family!r} biases q, k, v and o together (attention_bias): qkv_bias == o_bias")
    if family == "mistral" and (config.qkv_bias or config.o_bias):
        raise ValueError("family 'mistral' has no attention biases")
    if config.mlp_bias and family != "llama":
        raise ValueError(f"mlp_bias=True cannot be expressed in family {family!r} (only llama)")
    for name in ("gemma_norms", "sandwich_norms", "embed_scale"):
        if getattr(config, name) != gemma:
            raise ValueError(f"{name}={getattr(config, name)} cannot be expressed in family {family!r} "
                             f"(it has {name}={gemma})")
    if config.mlp_activation != ("gelu_tanh" if gemma else "silu"):
        raise ValueError(f"mlp_activation={config.mlp_activation!r} cannot be expressed in family {family!r}")
    if not gemma and (config.attn_soft_cap is not None or config.final_soft_cap is not None
                      or config.query_scale is not None):
        raise ValueError(f"soft caps and a query scale cannot be expressed in family {family!r} (only Gemma)")
    if family == "gemma3" and config.attn_soft_cap is not None:
        raise ValueError("attn_soft_cap cannot be expressed in family 'gemma3' (transformers ignores it there)")
    if config.local_rope_theta is not None and family != "gemma3":
        raise ValueError(f"local_rope_theta cannot be expressed in family {family!r} (only gemma3)")
    if config.layer_types is not None:
        if family == "llama":
            raise ValueError("layer_types cannot be expressed in family 'llama' (no sliding layers)")
        if family == "mistral" and "full_attention" in config.layer_types:
            raise ValueError("family 'mistral' slides every layer; layer_types must not name full_attention layers")


def hf_config_dict(config: ModelConfig, family: str, **extra: Any) -> dict:
    """A ``config.json`` dict of ``family`` (``qwen3``, ``qwen2``, ``llama``, ``mistral``, ``gemma2``,
    ``gemma3``) describing ``config``.

    ``extra`` keys are added as given (``eos_token_id``, ``max_position_embeddings``, ...).  The
    config's options must be expressible in the family (QK-norm only in qwen3 and gemma3, q/k/v biases
    without an output bias only in qwen2, Gemma's norms, MLP and embedding scale exactly in the
    Gemma families, ...): a ``ValueError`` names the option otherwise.  Sliding layers are written as
    ``layer_types`` (Mistral: ``sliding_window`` alone; Qwen: with ``use_sliding_window``); Gemma's
    query scale as ``query_pre_attn_scalar = query_scale ** -2`` (default ``head_dim``).
    """
    arch = _ARCHITECTURES.get(family)
    if arch is None:
        raise ValueError(f"family={family!r} is not supported; allowed: {', '.join(_ARCHITECTURES)}")
    _check_expressible(config, family)
    doc: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE.get(family, family),
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": 4096,
        "torch_dtype": config.dtype,
    }
    if family in ("qwen3", "llama", "gemma2", "gemma3"):
        doc["attention_bias"] = config.o_bias
    if family == "llama":
        doc["mlp_bias"] = config.mlp_bias
    sliding = config.layer_types is not None and config.sliding_window is not None
    if family == "mistral":
        doc["sliding_window"] = config.sliding_window if sliding else None
    if family in ("qwen2", "qwen3"):
        doc["use_sliding_window"] = sliding
        doc["sliding_window"] = config.sliding_window if sliding else None
        if config.layer_types is not None:
            doc["layer_types"] = list(config.layer_types)
    if family in ("gemma2", "gemma3"):
        del doc["hidden_act"]
        scale = config.query_scale if config.query_scale is not None else config.head_dim ** -0.5
        doc.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scale ** -2,
                   attn_logit_softcapping=config.attn_soft_cap, final_logit_softcapping=config.final_soft_cap,
                   sliding_window=config.sliding_window,
                   layer_types=list(config.layer_types or ("full_attention",) * config.num_layers))
    rs = config.rope_scaling
    if family == "gemma3":
        del doc["rope_theta"]
        full = {"rope_type": "default", "rope_theta": config.rope_theta}
        if rs is not None:
            full = {**_rope_scaling_dict(rs), "rope_theta": config.rope_theta}
        local_theta = config.local_rope_theta if config.local_rope_theta is not None else config.rope_theta
        local_rs = config.local_rope_scaling if config.local_rope_theta is not None else rs
        local = {"rope_type": "default", "rope_theta": local_theta}
        if local_rs is not None:
            local = {**_rope_scaling_dict(local_rs), "rope_theta": local_theta}
        doc["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    elif rs is not None:
        doc["rope_scaling"] = _rope_scaling_dict(rs)
    doc.update(extra)
    return doc


def save_checkpoint(
    directory: str | os.PathLike,
    params: dict,
    config: ModelConfig,
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "bfloat16",
    shards: int = 1,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``params`` as a Hugging Face checkpoint: ``config.json`` (``hf_config``), the tensors in
    ``dtype`` in one ``model.safetensors`` or ``shards`` files with an index, and optionally
    ``generation_config.json``.  Returns the directory."""
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards={shards!r} must be an integer >= 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(params, config, dtype)
    (directory / CONFIG_FILE).write_text(json.dumps(dict(hf_config), indent=2))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(dict(generation_config), indent=2))
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(directory / SINGLE_FILE, tensors, {"format": "pt"})
        return directory
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / fname, {n: tensors[n] for n in group}, {"format": "pt"})
        weight_map.update({n: fname for n in group})
    total = sum(int(a.nbytes) for a in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return directory


def save_random_checkpoint(
    directory: str | os.PathLike, hf_config: Mapping[str, Any], *, seed: int = 0, dtype: str = "bfloat16", shards: int = 1
) -> Path:
    """A checkpoint of ``hf_config``'s shape (e.g. Qwen3-0.6B's ``config.json``) with the decoder's
    deterministic random weights (:func:`~ninfer_kv.models.decoder.weights.init_params`)."""
    model, _ = model_config_from_hf(hf_config, dtype="float32")
    params = init_params(model, seed)
    return save_checkpoint(directory, params, model, hf_config, dtype=dtype, shards=shards)

