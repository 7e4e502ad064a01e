"""Token sampling inside the jitted steps: greedy, temperature, top-k, top-p, per-sequence PRNG keys.

Every sequence owns a key (:func:`sequence_key` of its seed).  The token a step produces at sequence
position ``p`` (the index the token will have in the sequence) is drawn with
``fold_in(key, p)`` — never with the batch row — so a fixed seed gives the same tokens across runs,
batch compositions, padding and forks (a fork from a checkpoint at frontier ``F`` continues with the
parent's key at positions ``>= F``).

Per row, with ``l = logits / temperature`` (float32):

1. **top-k** (``top_k > 0``): keep the tokens whose logit is at least the ``k``-th largest;
2. **top-p** (``top_p < 1``): over the softmax of what top-k kept, keep the smallest set of the most
   likely tokens whose probability sums to at least ``top_p`` (the most likely token always stays);
   tokens tied with the last kept one are kept too;
3. draw ``argmax(l_kept + g)`` with Gumbel noise ``g = gumbel(fold_in(key, p), (V,))``, which samples
   the softmax of the kept logits.

``temperature == 0`` is greedy (``argmax`` of the raw logits; top-k, top-p and the key are unused).
transformers applies its warpers in the same order (temperature, top-k, top-p).
:func:`filter_logits_reference` is the float32 numpy reference of steps 1 and 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "SamplingConfig",
    "SamplingRows",
    "GREEDY",
    "sequence_key",
    "sampling_rows",
    "filter_logits",
    "filter_logits_reference",
    "sample_tokens",
    "greedy_tokens",
]

_KEY_IMPL = "threefry2x32"
_KEY_WORDS = 2


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How one sequence picks its tokens (host side).

    Attributes:
      temperature: ``0`` for greedy; otherwise logits are divided by it (finite, > 0).
      top_k: keep the ``top_k`` most likely tokens (``0``: no limit).
      top_p: nucleus mass in ``(0, 1]`` (``1``: no limit).
      seed: the sequence's PRNG seed, an integer in ``[0, 2**32)``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t = _real(self.temperature)
        if t is None or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid; it must be a finite number >= 0 (0: greedy)")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < 2**31:
            raise ValueError(f"top_k={k!r} is invalid; it must be an integer in [0, 2**31) (0: no limit)")
        p = _real(self.top_p)
        if p is None or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is invalid; it must lie in (0, 1] (1: no limit)")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 2**32:
            raise ValueError(f"seed={s!r} is invalid; it must be an integer in [0, 2**32)")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", int(s))

    @property
    def greedy(self) -> bool:
        """``True`` when the sequence decodes greedily (temperature 0)."""
        return self.temperature == 0.0


def _real(value) -> float | None:
    """``value`` as a float when it is a real number (not a bool) a float can hold, else ``None``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return None


GREEDY = SamplingConfig()
"""Greedy decoding (temperature 0)."""


class SamplingRows(NamedTuple):
    """Per-row sampling inputs of a step (a pytree of arrays; data, never static).

    Attributes:
      temperature: float32 ``(B,)`` (0: greedy).
      top_k: int32 ``(B,)`` (0: no limit).
      top_p: float32 ``(B,)`` in ``(0, 1]``.
      key: uint32 ``(B, 2)`` raw threefry key data of each row's sequence (:func:`sequence_key`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array


def sequence_key(seed: int) -> np.ndarray:
    """uint32 ``(2,)`` raw key data of a sequence seeded with ``seed`` (``jax.random.key(seed)``'s data)."""
    SamplingConfig(seed=seed)  # validates
    return np.asarray(jax.random.key_data(jax.random.key(int(seed), impl=_KEY_IMPL)), np.uint32)


def sampling_rows(configs: Sequence[SamplingConfig], bucket: int) -> SamplingRows:
    """Host arrays of ``configs`` (one per real row) padded to ``bucket`` rows with greedy rows."""
    n = len(configs)
    if not isinstance(bucket, (int, np.integer)) or bucket < max(n, 1):
        raise ValueError(f"bucket={bucket!r} must be an integer >= the number of rows {n} (and >= 1)")
    temp = np.zeros(bucket, np.float32)
    top_k = np.zeros(bucket, np.int32)
    top_p = np.ones(bucket, np.float32)
    key = np.zeros((bucket, _KEY_WORDS), np.uint32)
    for i, c in enumerate(configs):
        if not isinstance(c, SamplingConfig):
            raise TypeError(f"configs[{i}] must be a SamplingConfig, got {type(c).__name__}")
        temp[i], top_k[i], top_p[i] = c.temperature, c.top_k, c.top_p
        key[i] = sequence_key(c.seed)
    return SamplingRows(temp, top_k, top_p, key)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """int32 ``argmax`` over the last axis (the first index on exact ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _limit_row(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """One row ``(V,)`` of scaled logits with ``-inf`` outside its top-k / top-p set."""
    v = scaled.shape[-1]
    neg = jnp.float32(-jnp.inf)
    desc = -jnp.sort(-scaled)  # descending
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    idx = jnp.arange(v)
    kth = desc[k - 1]
    ranked = jnp.where(idx < k, desc, neg)  # what top-k keeps, in order
    probs = jax.nn.softmax(ranked)
    before = jnp.cumsum(probs) - probs  # mass of the more likely tokens
    count = jnp.maximum(jnp.sum((before < top_p) & (idx < k)), 1)
    count = jnp.where(top_p >= 1, k, count)
    pth = desc[count - 1]
    return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, neg)


def filter_logits(logits: ArrayLike, temperature: ArrayLike, top_k: ArrayLike, top_p: ArrayLike) -> jax.Array:
    """float32 ``(B, V)`` temperature-scaled logits with ``-inf`` outside each row's top-k / top-p set.

    Rows with ``temperature == 0`` are scaled by 1 (they are decoded greedily by :func:`sample_tokens`).
    The per-row sort runs only when some row limits top-k or top-p.
    """
    logits = jnp.asarray(logits, jnp.float32)
    v = logits.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    scaled = logits / jnp.where(temperature > 0, temperature, jnp.float32(1))[:, None]
    limited = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1))
    return jax.lax.cond(limited, lambda s: jax.vmap(_limit_row)(s, top_k, top_p), lambda s: s, scaled)


def filter_logits_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float32 numpy reference of :func:`filter_logits` for one row ``(V,)``."""
    x = np.asarray(logits, np.float32)
    v = x.shape[-1]
    scaled = x / np.float32(temperature if temperature > 0 else 1.0)
    k = top_k if 0 < top_k < v else v
    if k == v and top_p >= 1:
        return scaled
    order = np.argsort(-scaled, kind="stable")
    desc = scaled[order]
    kept = desc[:k]
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    count = k if top_p >= 1 else max(int(np.sum(before < top_p)), 1)
    threshold = max(desc[k - 1], desc[count - 1])
    return np.where(scaled >= threshold, scaled, np.float32(-np.inf)).astype(np.float32)


def _gumbel(key_data: jax.Array, position: jax.Array, v: int) -> jax.Array:
    key = jax.random.wrap_key_data(key_data, impl=_KEY_IMPL)
    return jax.random.gumbel(jax.random.fold_in(key, position), (v,), jnp.float32)


def sample_tokens(logits: ArrayLike, sampling: SamplingRows, positions: ArrayLike) -> jax.Array:
    """int32 ``(B,)`` tokens from float32 ``logits (B, V)``; ``positions (B,)`` is the sequence index of
    the token each row produces (the key is folded with it).  Greedy rows take the argmax."""
    logits = jnp.asarray(logits, jnp.float32)
    v = logits.shape[-1]
    filtered = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    noise = jax.vmap(lambda k, p: _gumbel(k, p, v))(jnp.asarray(sampling.key, jnp.uint32), jnp.asarray(positions, jnp.int32))
    drawn = jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(sampling.temperature) > 0, drawn, greedy_tokens(logits))
