"""The demo's cache of Hugging Face checkpoints (``DemoConfig.model`` naming a directory).

A checkpoint is read at most once per directory, served context and *stamp* (the names, sizes and
modification times of the directory's files), so a changed checkpoint is read again.  The model
configuration and the stop tokens come from ``config.json`` alone (no weights read; several kept),
the float32 weights from the safetensors (the last two kept).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..models.decoder import ModelConfig

__all__ = ["checkpoint_config", "checkpoint_params"]


def _stamp(directory: str) -> tuple:
    """The names, sizes and modification times of a directory's files (a changed checkpoint is re-read)."""
    entries = sorted(os.scandir(directory), key=lambda e: e.name)
    return tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())


def checkpoint_config(directory: str, max_context: int) -> tuple[ModelConfig, tuple[int, ...]]:
    """The float32 model configuration and the stop tokens of a checkpoint directory (no weights read)."""
    return _checkpoint_config_at(directory, max_context, _stamp(directory))


@functools.lru_cache(maxsize=8)
def _checkpoint_config_at(directory: str, max_context: int, stamp: tuple) -> tuple[ModelConfig, tuple[int, ...]]:
    from ..models.hf import eos_token_ids, model_config_from_hf, read_config

    model, info = model_config_from_hf(read_config(directory), dtype="float32", max_context=max_context)
    return model, eos_token_ids(directory, info.eos_token_ids, vocab_size=model.vocab_size)


def checkpoint_params(directory: str, max_context: int) -> dict:
    """The float32 parameters of a checkpoint directory, served at ``max_context``."""
    return _checkpoint_params_at(directory, max_context, _stamp(directory))


@functools.lru_cache(maxsize=2)
def _checkpoint_params_at(directory: str, max_context: int, stamp: tuple) -> dict:
    from ..models.hf import load_checkpoint

    return load_checkpoint(directory, dtype="float32", max_context=max_context).params
