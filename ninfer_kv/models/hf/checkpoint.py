"""Hugging Face checkpoint directories: load (memory-mapped) into the decoder's parameter tree, and write.

A directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).  Loading runs in stages,
and nothing is built until every check passed:

1. ``config.json`` is mapped (:func:`~ninfer_kv.models.hf.config.model_config_from_hf`): an option
   that cannot be served is refused before any tensor is looked at;
2. every shard's header is read and validated (:func:`~ninfer_kv.models.hf.safetensors_io.read_header`:
   offsets inside the file, so a truncated file is named with the first tensor it cuts);
3. the inventory is checked against the configuration: every expected tensor present (in the shard
   the index names), with the expected shape and a float dtype (BF16, F16, F32), no unexpected
   tensor (``rotary_emb.inv_freq`` buffers and, with tied embeddings, ``lm_head.weight`` are ignored);
4. the tensors are copied from the memory-mapped files to the device and cast to the configured dtype.

Any failure raises a :class:`~ninfer_kv.models.hf.config.CheckpointError` naming the file, tensor or
option; no partial parameter tree is ever returned.

Tensor names are transformers' (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
...).  Projections keep transformers' ``(out, in)`` orientation in the decoder, so loading is a copy,
never a transpose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np

from ..decoder.config import ModelConfig
from ..decoder.weights import init_params, layer_param_shapes
from .config import CheckpointError, HFModelInfo, model_config_from_hf
from .safetensors_io import SafetensorsError, TensorInfo, read_header, tensor, write_safetensors

__all__ = [
    "LoadedModel",
    "CheckpointPlan",
    "SINGLE_FILE",
    "INDEX_FILE",
    "read_config",
    "plan_checkpoint",
    "load_checkpoint",
    "expected_tensors",
    "checkpoint_tensors",
    "hf_config_dict",
    "save_checkpoint",
    "save_random_checkpoint",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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


def expected_tensors(config: ModelConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """transformers tensor name -> (location in the parameter tree, shape) for ``config``.

    A location is a key path: ``("embed",)``, ``("layers", 3, "wq")``, ...
    """
    out: dict[str, tuple[tuple, tuple[int, ...]]] = {
        "model.embed_tokens.weight": (("embed",), (config.vocab_size, config.d_model)),
        "model.norm.weight": (("final_norm",), (config.d_model,)),
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = (("lm_head",), (config.vocab_size, config.d_model))
    shapes = layer_param_shapes(config)
    for i in range(config.num_layers):
        for key, shape in shapes.items():
            out[f"model.layers.{i}.{_LAYER_NAMES[key]}"] = (("layers", i, key), shape)
    return out


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_embeddings and name == "lm_head.weight"


def read_config(directory: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of a checkpoint directory (``CheckpointError`` naming the problem)."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: not a directory (a Hugging Face checkpoint directory with config.json)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return cfg


def _shard_files(directory: Path) -> tuple[dict[str, str] | None, list[Path]]:
    """``(weight_map or None, shard paths)``; the index wins when both forms are present."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            doc = json.loads(index.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: cannot be read as JSON ({exc})") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        for f in files:
            if Path(f).name != f:
                raise CheckpointError(f"{index}: shard {f!r} must be a file name inside the checkpoint directory")
            if not (directory / f).is_file():
                raise CheckpointError(f"{index}: shard {f!r} does not exist in {directory}")
        return weight_map, [directory / f for f in files]
    single = directory / SINGLE_FILE
    if single.is_file():
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
    """

    directory: Path
    config: ModelConfig
    info: HFModelInfo
    tensors: Mapping[str, tuple[tuple, TensorInfo]]
    ignored: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the load reads."""
        return sum(t.nbytes for _, t in self.tensors.values())


def plan_checkpoint(
    directory: str | os.PathLike, *, dtype: str = "bfloat16", max_context: int | None = None
) -> CheckpointPlan:
    """Stages 1-3 of a load (module docstring): map the config, read the headers, check the inventory."""
    directory = Path(directory)
    model, info = model_config_from_hf(read_config(directory), dtype=dtype, max_context=max_context)
    weight_map, files = _shard_files(directory)
    found: dict[str, TensorInfo] = {}
    for path in files:
        try:
            header = read_header(path)
        except SafetensorsError as exc:
            raise CheckpointError(str(exc)) from None
        for name, t in header.tensors.items():
            if weight_map is not None and weight_map.get(name) not in (None, path.name):
                continue  # the index names another shard for it
            if name in found:
                raise CheckpointError(f"tensor {name!r} is in both {found[name].path.name} and {path.name}")
            found[name] = t
    expected = expected_tensors(model)
    if weight_map is not None:
        for name, f in weight_map.items():
            if name in expected and name not in found:
                raise CheckpointError(f"tensor {name!r}: {INDEX_FILE} names shard {f!r}, which does not hold it")
    tensors: dict[str, tuple[tuple, TensorInfo]] = {}
    for name, (where, shape) in expected.items():
        t = found.get(name)
        if t is None:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint ({info.architecture}, {model.num_layers} layers, "
                f"shape {shape} expected)"
            )
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
                f"unexpected tensor {name!r} in {found[name].path.name}: the {info.architecture} config "
                f"(qk_norm={model.qk_norm}, qkv_bias={model.qkv_bias}, o_bias={model.o_bias}, mlp_bias={model.mlp_bias}, "
                f"tie_embeddings={model.tie_embeddings}, {model.num_layers} layers) has no such parameter"
            )
        ignored.append(name)
    return CheckpointPlan(directory, model, info, tensors, tuple(sorted(ignored)))


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A loaded checkpoint.

    Attributes:
      directory: where it was loaded from.
      config: the decoder configuration.
      info: the rest of ``config.json``.
      params: the parameter tree (device arrays in ``config.dtype``).
      bytes_read: tensor bytes copied from the files.
      load_seconds: wall time of the whole load (config, headers, copies).
    """

    directory: Path
    config: ModelConfig
    info: HFModelInfo
    params: dict
    bytes_read: int
    load_seconds: float


def _set(tree: dict, where: tuple, value) -> None:
    if where[0] == "layers":
        tree["layers"][where[1]][where[2]] = value
    else:
        tree[where[0]] = value


def load_checkpoint(
    directory: str | os.PathLike, *, dtype: str = "bfloat16", max_context: int | None = None
) -> LoadedModel:
    """Load a Hugging Face checkpoint directory (see the module docstring).

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
    for name, (where, info) in plan.tensors.items():
        try:
            host = tensor(info)
            arr = jax.device_put(np.asarray(host))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"tensor {name!r} in {info.path}: cannot be read ({exc})") from None
        if arr.dtype != target:
            arr = cast(arr)
        _set(tree, where, arr)
    jax.block_until_ready(tree)
    return LoadedModel(plan.directory, plan.config, plan.info, tree, plan.nbytes, time.perf_counter() - start)


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


def hf_config_dict(config: ModelConfig, family: str, **extra: Any) -> dict:
    """A ``config.json`` dict of ``family`` (``qwen3``, ``qwen2``, ``llama``, ``mistral``) describing ``config``.

    ``extra`` keys are added as given (``eos_token_id``, ``max_position_embeddings``, ...).  The
    config's options must be expressible in the family (QK-norm only in qwen3, q/k/v biases without an
    output bias only in qwen2, ...): a ``ValueError`` names the option otherwise.
    """
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM"}.get(family)
    if arch is None:
        raise ValueError(f"family={family!r} is not supported; allowed: qwen3, qwen2, llama, mistral")
    want_qk = family == "qwen3"
    if config.qk_norm != want_qk:
        raise ValueError(f"qk_norm={config.qk_norm} cannot be expressed in family {family!r} (it has qk_norm={want_qk})")
    if family == "qwen2" and (not config.qkv_bias or config.o_bias):
        raise ValueError("family 'qwen2' has q/k/v biases and no output bias (qkv_bias=True, o_bias=False)")
    if family in ("qwen3", "llama") and config.qkv_bias != config.o_bias:
        raise ValueError(f"family {family!r} biases q, k, v and o together (attention_bias): qkv_bias == o_bias")
    if family == "mistral" and (config.qkv_bias or config.o_bias):
        raise ValueError("family 'mistral' has no attention biases")
    if config.mlp_bias and family != "llama":
        raise ValueError(f"mlp_bias=True cannot be expressed in family {family!r} (only llama)")
    doc: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family,
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
    if family in ("qwen3", "llama"):
        doc["attention_bias"] = config.o_bias
    if family == "llama":
        doc["mlp_bias"] = config.mlp_bias
    if family == "mistral":
        doc["sliding_window"] = None
    rs = config.rope_scaling
    if rs is not None:
        scaling: dict[str, Any] = {"rope_type": rs.kind, "factor": rs.factor}
        if rs.kind in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = rs.original_max_position_embeddings
        if rs.kind == "llama3":
            scaling.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
        if rs.kind == "yarn":
            scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)
            if rs.attention_factor is not None:
                scaling["attention_factor"] = rs.attention_factor
        doc["rope_scaling"] = scaling
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
    (directory / "config.json").write_text(json.dumps(dict(hf_config), indent=2))
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

