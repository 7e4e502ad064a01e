"""Shared helpers of the example-model tests: hand-built block tables and prefill/decode drivers.

Block tables are built the way a store would publish them: each execution row maps its logical
blocks to a random permutation of physical page IDs, and every step receives a fresh device copy
(the steps donate their tables).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ninfer_kv.models.decoder import StepConfig, make_steps, prompt_chunks

TOL_BF16 = 1e-4  # paged vs dense logits, BF16 profile (float32 model; observed ~3e-6)
TOL_QUANT = 1e-3  # paged vs dense-with-codec-round-trip logits, quantized profiles (observed ~3e-6)


def random_tables(rng: np.random.Generator, rows: int, blocks: int, num_pages: int) -> np.ndarray:
    """int32 ``(rows, blocks)``: distinct physical page IDs drawn as a random permutation of ``[0, num_pages)``."""
    assert num_pages >= rows * blocks
    return rng.permutation(num_pages)[: rows * blocks].reshape(rows, blocks).astype(np.int32)


def i32(x) -> np.ndarray:
    return np.asarray(x, np.int32)


def prefill(steps, params, planes, tables: np.ndarray, prompt: np.ndarray, rows, start: int = 0):
    """Chunked prefill of equal-length prompts ``(B, S)`` from position ``start``; returns (planes, last output)."""
    b, s = prompt.shape
    chunk = steps.config.prefill_chunk
    out = None
    for offset, valid in prompt_chunks(s, chunk):
        tokens = np.zeros((b, chunk), np.int32)
        tokens[:, :valid] = prompt[:, offset : offset + valid]
        out = steps.prefill(
            params, planes, jnp.asarray(tables), tokens, i32([start + offset] * b), i32([valid] * b), i32(rows)
        )
        planes = out.planes
    return planes, out


def greedy_decode(steps, params, planes, tables: np.ndarray, first_tokens, position: int, rows, num_steps: int):
    """Feed ``first_tokens (B,)`` at ``position`` and decode greedily; returns (planes, tokens, logits, hiddens).

    ``tokens[:, i]`` is the token chosen by decode step ``i`` (the token at ``position + i + 1``).
    """
    tok = np.asarray(first_tokens, np.int32)
    b = tok.shape[0]
    toks, logits, hiddens = [], [], []
    for i in range(num_steps):
        out = steps.decode(params, planes, jnp.asarray(tables), tok[:, None], i32([position + i] * b), i32([1] * b), i32(rows))
        planes = out.planes
        tok = np.asarray(out.next_tokens)
        toks.append(tok)
        logits.append(np.asarray(out.logits))
        hiddens.append(np.asarray(out.hidden[:, 0]))
    return planes, np.stack(toks, 1), np.stack(logits, 1), np.stack(hiddens, 1)


@functools.lru_cache(maxsize=None)
def make(model_config, profile="bf16", impl="reference", **kw):
    """Step functions for a configuration, shared by every test that asks for an equal one."""
    return make_steps(StepConfig(model=model_config, profile=profile, impl=impl, **kw))


def copy_planes(planes: dict) -> dict:
    return {k: jnp.array(v, copy=True) for k, v in planes.items()}
