"""Hugging Face checkpoints served by the paged decoder: Qwen3, Qwen2/2.5, Llama 2/3/3.1, Mistral,
Gemma 2 and Gemma 3 (sliding windows included).

* :mod:`.config` — ``config.json`` mapped onto :class:`~ninfer_kv.models.decoder.config.ModelConfig`,
  with every option that cannot be served refused by name and value (:class:`UnsupportedModelError`)
  and every value range-checked;
* :mod:`.bounded_files` — bounded reading of checkpoint files: regular files only (never blocking on
  a FIFO), sizes capped, strict UTF-8, JSON nesting capped before parsing;
* :mod:`.safetensors_io` — the safetensors format, validated with exact integer arithmetic, read into
  fresh numpy arrays (bfloat16 included), and written;
* :mod:`.checkpoint` — :func:`load_checkpoint` (``model.safetensors`` or a sharded index; config,
  headers and inventory checked before anything is copied; BF16/F16/F32 cast to the served dtype;
  the parameters are process-owned copies and every file is closed on return),
  and :func:`save_checkpoint` / :func:`save_random_checkpoint` to write transformers-named checkpoints;
* :mod:`.tokenizer` — ``tokenizer.json`` through the optional ``tokenizers`` package, the EOS ids of
  ``generation_config.json`` / ``config.json``, streaming decode.

Every refusal is one :class:`CheckpointError` (:class:`SafetensorsError` and
:class:`UnsupportedModelError` are subclasses) naming the file and the key or tensor.

Loading needs only numpy and JAX; the tokenizer needs the ``hf`` extra (``pip install "ninfer_kv[hf]"``).
"""

from .checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointPlan,
    LoadedModel,
    checkpoint_tensors,
    expected_tensor_count,
    expected_tensors,
    hf_config_dict,
    iter_expected_tensors,
    load_checkpoint,
    plan_checkpoint,
    read_config,
    save_checkpoint,
    save_random_checkpoint,
)
from .config import FAMILIES, CheckpointError, HFModelInfo, UnsupportedModelError, model_config_from_hf
from .safetensors_io import SafetensorsError, read_header, read_tensors, write_safetensors
from .tokenizer import StreamDecoder, TextTokenizer, eos_token_ids, load_tokenizer

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointPlan",
    "LoadedModel",
    "checkpoint_tensors",
    "expected_tensor_count",
    "expected_tensors",
    "hf_config_dict",
    "iter_expected_tensors",
    "load_checkpoint",
    "plan_checkpoint",
    "read_config",
    "save_checkpoint",
    "save_random_checkpoint",
    "FAMILIES",
    "CheckpointError",
    "HFModelInfo",
    "UnsupportedModelError",
    "model_config_from_hf",
    "SafetensorsError",
    "read_header",
    "read_tensors",
    "write_safetensors",
    "StreamDecoder",
    "TextTokenizer",
    "eos_token_ids",
    "load_tokenizer",
]
