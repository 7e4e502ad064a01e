"""Dense references of the example decoder.

* :func:`dense_logits` / :func:`dense_greedy_generate`: no cache at all.  Every call recomputes
  the whole sequence with plain causal attention (each layer's window, soft cap and query scale
  applied: :meth:`~ninfer_kv.models.decoder.config.ModelConfig.attention_options`); K (after RoPE) and V pass through
  ``ninfer_kv.ops.codecs.codec_roundtrip(profile, k, v)`` first, so the result is what a consumer of a
  paged cache in ``profile`` sees (quantized profiles included).  This is the ground truth the
  paged step functions are tested against.
* :func:`dense_mtp_forward`: the same for the MTP head over explicit (hidden, next token) pairs.
* :class:`DenseKVCache` and :func:`make_dense_cache_steps`: the usual contiguous KV cache, one
  ``(B, H, S, D)`` array per layer, written at each row's position and read whole under a causal
  mask (and each layer's options) — the baseline the paged decode is benchmarked against.  It stores K/V in ``cache_dtype``
  (bfloat16 by default: the bytes of the BF16 profile).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv.ops import codecs
from ninfer_kv.schema.profiles import KVProfile

from .config import ModelConfig
from .layers import token_positions
from .model import Attend, decoder_layer, embed_tokens, logits_from_hidden
from .mtp import mtp_layer

__all__ = [
    "causal_attention",
    "dense_forward",
    "dense_logits",
    "dense_greedy_generate",
    "dense_mtp_forward",
    "DenseKVCache",
    "init_dense_cache",
    "dense_cache_forward",
    "DenseCacheSteps",
    "make_dense_cache_steps",
]

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *, heads_first: bool = False,
    sm_scale: float | None = None, soft_cap: float | None = None,
) -> jax.Array:
    """float32 GQA attention; query head ``h`` reads KV head ``h // (Hq // H)``.

    Args:
      q: ``(B, T, Hq, D)``; k, v: ``(B, J, H, D)`` (or ``(B, H, J, D)`` with ``heads_first``);
      visible: bool ``(B, T, J)`` (a window is part of it).
      sm_scale: the score scale (``None``: divide by ``sqrt(D)``).
      soft_cap: ``None``, or scores become ``soft_cap * tanh(s / soft_cap)`` before the softmax.
    Returns: ``(B, T, Hq, D)`` in q's dtype; a query with no visible key gets zeros.
    """
    b, t, hq, d = q.shape
    h = k.shape[1] if heads_first else k.shape[2]
    kv = "bhjd" if heads_first else "bjhd"
    qf = q.astype(_F32).reshape(b, t, h, hq // h, d)
    s = jnp.einsum(f"bthgd,{kv}->bhgtj", qf, k.astype(_F32), precision=_HI)
    s = s / np.float32(np.sqrt(d)) if sm_scale is None else s * np.float32(sm_scale)
    if soft_cap is not None:
        s = np.float32(soft_cap) * jnp.tanh(s / np.float32(soft_cap))
    vis = visible[:, None, None]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    o = jnp.einsum(f"bhgtj,{kv}->bthgd", p, v.astype(_F32), precision=_HI)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def _attention_mask(query_pos: jax.Array, key_pos: jax.Array, window: int | None) -> jax.Array:
    """bool ``(..., T, J)``: key at ``key_pos`` visible to the query at ``query_pos`` (causal, and
    within ``window`` positions when given: ``query - window < key <= query``)."""
    q, j = query_pos[..., :, None], key_pos[..., None, :]
    visible = j <= q
    if window is not None:
        visible &= j > q - window
    return visible


def _dense_attend(profile: KVProfile, options: dict) -> Attend:
    """Causal attention over the whole sequence (positions 0..S-1) after the codec round trip, with
    a layer's ``options`` (:meth:`ModelConfig.attention_options`)."""

    def attend(q, k, v):
        kr, vr = codecs.codec_roundtrip(profile, k, v)
        s = q.shape[1]
        pos = jnp.arange(s, dtype=jnp.int32)
        visible = _attention_mask(pos, pos, options.get("window"))[None]
        return causal_attention(q, kr, vr, jnp.broadcast_to(visible, (q.shape[0], s, s)),
                                sm_scale=options.get("sm_scale"), soft_cap=options.get("soft_cap")), None

    return attend


def _as_batch(tokens) -> jax.Array:
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (S,) or (B, S), got shape {tuple(tokens.shape)}")
    return tokens


@functools.partial(jax.jit, static_argnames=("config", "profile"))
def _dense_forward(params, tokens, *, config: ModelConfig, profile: KVProfile):
    b, s = tokens.shape
    token_pos = token_positions(jnp.zeros((b,), jnp.int32), s)
    h = embed_tokens(params, tokens, config)
    for layer, lp in enumerate(params["layers"]):
        h, _ = decoder_layer(lp, config, h, token_pos, _dense_attend(profile, config.attention_options(layer)), layer)
    return h


def dense_forward(params: dict, config: ModelConfig, tokens, profile: "KVProfile | str" = KVProfile.BF16):
    """Final hidden states ``(B, S, d_model)`` (before the final norm) of a whole sequence from position 0."""
    return _dense_forward(params, _as_batch(tokens), config=config, profile=KVProfile.parse(profile))


def dense_logits(params: dict, config: ModelConfig, tokens, profile: "KVProfile | str" = KVProfile.BF16):
    """float32 logits ``(B, S, V)`` of every position of ``tokens`` ``(S,)`` or ``(B, S)``."""
    return logits_from_hidden(params, config, dense_forward(params, config, tokens, profile))


def dense_greedy_generate(
    params: dict, config: ModelConfig, prompt, num_new: int, profile: "KVProfile | str" = KVProfile.BF16
):
    """Greedy continuation by full recomputation.

    Returns ``(tokens int32 (B, num_new), logits float32 (B, num_new, V))``: ``logits[:, i]`` are
    the logits that chose ``tokens[:, i]``.  The sequence is held at a fixed padded length
    ``S0 + num_new`` (causal attention makes the padding invisible), so this compiles once.
    """
    prompt = _as_batch(prompt)
    b, s0 = prompt.shape
    if not isinstance(num_new, int) or num_new < 1:
        raise ValueError(f"num_new={num_new!r} must be an integer >= 1")
    seq = jnp.concatenate([prompt, jnp.zeros((b, num_new), jnp.int32)], axis=1)
    toks, logs = [], []
    for i in range(num_new):
        logits = dense_logits(params, config, seq, profile)[:, s0 + i - 1]
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        seq = seq.at[:, s0 + i].set(tok)
        toks.append(tok)
        logs.append(logits)
    return jnp.stack(toks, axis=1), jnp.stack(logs, axis=1)


@functools.partial(jax.jit, static_argnames=("config", "profile"))
def _dense_mtp(params, hidden, next_tokens, *, config: ModelConfig, profile: KVProfile):
    b, s = next_tokens.shape
    token_pos = token_positions(jnp.zeros((b,), jnp.int32), s)
    g, logits, _ = mtp_layer(params, config, hidden, next_tokens, token_pos,
                             _dense_attend(profile, config.attention_options(None)))
    return g, logits


def dense_mtp_forward(
    params: dict, config: ModelConfig, hidden, next_tokens, profile: "KVProfile | str" = KVProfile.BF16
):
    """MTP hidden ``g (B, S, d)`` and float32 logits ``(B, S, V)`` for pairs ``(hidden[:, i], next_tokens[:, i])``
    at positions ``0..S-1``, with causal attention over the codec round trip of the MTP K/V."""
    return _dense_mtp(params, hidden, _as_batch(next_tokens), config=config, profile=KVProfile.parse(profile))


# -- dense contiguous KV cache (benchmark baseline) -------------------------------------------------


class DenseKVCache(NamedTuple):
    """Contiguous per-row KV cache: ``k``, ``v`` are tuples of one ``(B, H, S, D)`` array per layer.

    Row ``b`` holds positions ``0..S-1`` of its sequence contiguously (the common per-layer
    ``(batch, heads, seq, head_dim)`` layout).
    """

    k: tuple
    v: tuple

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in self.k + self.v)


def init_dense_cache(config: ModelConfig, batch: int, max_len: int, cache_dtype=jnp.bfloat16) -> DenseKVCache:
    """A zeroed cache of ``max_len`` positions per row."""
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    layers = range(config.num_layers)
    return DenseKVCache(tuple(jnp.zeros(shape, cache_dtype) for _ in layers), tuple(jnp.zeros(shape, cache_dtype) for _ in layers))


def _write_rows(cache: jax.Array, x: jax.Array, positions: jax.Array) -> jax.Array:
    """``cache[b, :, positions[b] + t] = x[b, t]`` for every row and ``t < T``.

    A masked select over the row: under donation XLA updates the cache in place, whereas a
    per-row ``dynamic_update_slice`` (a scatter once rows have different positions) makes XLA CPU
    copy the whole cache every step.
    """
    t = x.shape[1]
    s = cache.shape[2]
    rel = jnp.arange(s, dtype=jnp.int32)[None, :] - positions[:, None]  # (B, S): t index of slot s
    inside = (rel >= 0) & (rel < t)
    vals = jnp.swapaxes(x, 1, 2).astype(cache.dtype)  # (B, H, T, D)
    if t == 1:
        src = jnp.broadcast_to(vals, cache.shape)
    else:
        idx = jnp.clip(rel, 0, t - 1)[:, None, :, None]
        src = jnp.take_along_axis(vals, jnp.broadcast_to(idx, cache.shape[:3] + (1,)), axis=2)
    return jnp.where(inside[:, None, :, None], src, cache)


def _cache_attend(ck, cv, positions, visible, options: dict) -> Attend:
    """Write the chunk's K/V into one layer's cache, then attend over the whole layer (``visible``
    holds the layer's window; ``options`` its soft cap and scale)."""

    def attend(q, k, v):
        # The barrier keeps the in-place update and the attention's read of the updated layer in
        # that order (otherwise XLA fuses the select into both consumers and copies the cache).
        nk, nv = jax.lax.optimization_barrier((_write_rows(ck, k, positions), _write_rows(cv, v, positions)))
        out = causal_attention(q, nk, nv, visible, heads_first=True, sm_scale=options.get("sm_scale"),
                               soft_cap=options.get("soft_cap"))
        return out, (nk, nv)

    return attend


def dense_cache_forward(params: dict, config: ModelConfig, cache: DenseKVCache, tokens, positions):
    """Run a chunk ``tokens (B, T)`` at ``positions (B,)`` against the contiguous cache.

    Writes the chunk's K/V at ``positions[b] + t`` and attends causally (key ``j`` visible iff
    ``j <= positions[b] + t``, and ``j > positions[b] + t - window`` in a layer with a window).
    Returns ``(hidden (B, T, d), cache)``.
    """
    positions = jnp.asarray(positions, jnp.int32)
    b, t = tokens.shape
    token_pos = token_positions(positions, t)
    s = cache.k[0].shape[2]
    slots = jnp.arange(s, dtype=jnp.int32)[None, :]
    h = embed_tokens(params, tokens, config)
    ks, vs = list(cache.k), list(cache.v)
    for layer, lp in enumerate(params["layers"]):
        options = config.attention_options(layer)
        visible = _attention_mask(token_pos, slots, options.get("window"))
        attend = _cache_attend(ks[layer], vs[layer], positions, visible, options)
        h, (ks[layer], vs[layer]) = decoder_layer(lp, config, h, token_pos, attend, layer)
    return h, DenseKVCache(tuple(ks), tuple(vs))


class DenseCacheSteps:
    """Jitted prefill/decode over a :class:`DenseKVCache` (cache donated).

    ``prefill(params, cache, tokens (B, T), positions (B,)) -> (cache, next_tokens (B,))`` and
    ``decode(params, cache, tokens (B, 1), positions (B,)) -> (cache, logits (B, V), next_tokens (B,))``.
    """

    def __init__(self, config: ModelConfig):
        self.config = config

        def prefill(params, cache, tokens, positions):
            h, cache = dense_cache_forward(params, config, cache, tokens, positions)
            logits = logits_from_hidden(params, config, h[:, -1])
            return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def decode(params, cache, tokens, positions):
            h, cache = dense_cache_forward(params, config, cache, tokens, positions)
            logits = logits_from_hidden(params, config, h[:, 0])
            return cache, logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        self.prefill = jax.jit(prefill, donate_argnums=(1,))
        self.decode = jax.jit(decode, donate_argnums=(1,))


def make_dense_cache_steps(config: ModelConfig) -> DenseCacheSteps:
    """Jitted step functions over the dense contiguous KV cache."""
    return DenseCacheSteps(config)
