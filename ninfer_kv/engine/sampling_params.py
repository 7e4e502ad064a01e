"""How a request generates: :class:`SamplingParams`, with vLLM's names and meanings.

Every field is checked when the object is made; a bad value raises :class:`ValueError` (a value out
of range) or :class:`TypeError` (a value of the wrong kind: a float ``max_tokens``, a bool where an
integer is needed) naming the field, the value and what is allowed.  The bounds are the module
constants below.

The decoder samples on the device with a
:class:`~ninfer_kv.models.decoder.sampling.SamplingConfig`; :meth:`SamplingParams.sampling_config`
makes one.  This module imports no JAX until that method is called.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ninfer_kv.models.decoder.sampling import SamplingConfig

__all__ = [
    "SamplingParams",
    "MAX_TOKENS_LIMIT",
    "MAX_TEMPERATURE",
    "MAX_TOP_K",
    "SEED_LIMIT",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_LOGPROBS",
    "MAX_N",
]

MAX_TOKENS_LIMIT = 2**31 - 64
"""Largest ``max_tokens`` (positions are int32 on the device; the margin leaves room for a prompt)."""

MAX_TEMPERATURE = 100.0
"""Largest ``temperature`` (beyond it sampling is uniform for any practical logits)."""

MAX_TOP_K = 2**31 - 1
"""Largest ``top_k`` (an int32 on the device; any value at least the vocabulary size means no limit)."""

SEED_LIMIT = 2**32
"""``seed`` lies in ``[0, SEED_LIMIT)`` (the device's PRNG key is seeded with 32 bits)."""

MAX_STOP_STRINGS = 16
"""Most stop strings a request may give."""

MAX_STOP_STRING_CHARS = 1024
"""Longest stop string, in characters."""

MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids a request may give."""

MAX_LOGPROBS = 20
"""Largest ``logprobs``: top alternatives reported per generated token besides the chosen one."""

MAX_N = 128
"""Most completions one request may ask for."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _int(name: str, value: Any, low: int, high: int, note: str = "") -> int:
    if not _is_int(value):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; it must be an integer in [{low}, {high}]{note}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} is out of range; it must be an integer in [{low}, {high}]{note}")
    return value


def _float(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; it must be a number {allowed}")
    try:
        out = float(value)
    except (OverflowError, ValueError, TypeError):
        raise ValueError(f"{name}={value!r} is out of range; it must be a number {allowed}") from None
    if not math.isfinite(out):
        raise ValueError(f"{name}={value!r} is not finite; it must be a number {allowed}")
    return out


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"stop={value!r} is a {type(value).__name__}; it must be None, a str or a list of str")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}]={s!r} is a {type(s).__name__}; every stop string must be a str")
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop[{i}]={s[:40]!r}{'...' if len(s) > 40 else ''} has {len(s)} characters; "
                f"a stop string has 1 to {MAX_STOP_STRING_CHARS} characters"
            )
    return tuple(str(s) for s in items)


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"stop_token_ids={value!r} is a {type(value).__name__}; it must be None or a list of int")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    return tuple(_int(f"stop_token_ids[{i}]", t, 0, 2**31 - 1) for i, t in enumerate(value))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request generates (vLLM's ``SamplingParams``: the same names, defaults and meanings).

    Attributes:
      max_tokens: most tokens to generate per completion, an integer in ``[1, MAX_TOKENS_LIMIT]``;
        ``None``: until the model's context is full.
      temperature: a finite number in ``[0, MAX_TEMPERATURE]``; ``0`` decodes greedily.
      top_p: nucleus mass in ``(0, 1]`` (``1``: no limit).
      top_k: keep the ``top_k`` most likely tokens, an integer in ``[0, MAX_TOP_K]`` (``0``: no limit;
        ``-1``, vLLM's spelling of "no limit", is stored as ``0``).
      seed: the request's PRNG seed in ``[0, SEED_LIMIT)``, or ``None`` for one the engine picks.
      stop: strings that end a completion when they appear in its text (the string itself is not
        part of the text); given as ``None``, a str or a list of str, stored as a tuple (``()`` for
        none); at most :data:`MAX_STOP_STRINGS`, each of 1 to :data:`MAX_STOP_STRING_CHARS` characters.
      stop_token_ids: token ids that end a completion (the token is kept in ``token_ids``, its text
        is not added), stored as a tuple (``()`` for none); at most :data:`MAX_STOP_TOKEN_IDS`
        integers ``>= 0``.
      ignore_eos: keep generating after the model's end-of-sequence tokens.
      logprobs: ``None``, or report the log-probability of each generated token and of this many
        most likely alternatives, an integer in ``[0, MAX_LOGPROBS]``.
      n: completions to generate for the prompt, an integer in ``[1, MAX_N]``.
    Raises:
      TypeError: a value of the wrong kind.
      ValueError: a value out of its range.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.max_tokens is not None:
            put("max_tokens", _int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT, " or None (up to the context)"))
        t = _float("temperature", self.temperature, f"in [0, {MAX_TEMPERATURE:g}] (0: greedy)")
        if not 0.0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature!r} is out of range; it must lie in [0, {MAX_TEMPERATURE:g}] (0: greedy)")
        put("temperature", t)
        p = _float("top_p", self.top_p, "in (0, 1] (1: no limit)")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is out of range; it must lie in (0, 1] (1: no limit)")
        put("top_p", p)
        k = _int("top_k", self.top_k, -1, MAX_TOP_K, " (0 or -1: no limit)")
        put("top_k", max(k, 0))
        if self.seed is not None:
            put("seed", _int("seed", self.seed, 0, SEED_LIMIT - 1, " or None"))
        put("stop", _stop(self.stop))
        put("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"ignore_eos={self.ignore_eos!r} is a {type(self.ignore_eos).__name__}; it must be a bool")
        put("ignore_eos", bool(self.ignore_eos))
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, " or None"))
        put("n", _int("n", self.n, 1, MAX_N))

    @property
    def greedy(self) -> bool:
        """``True`` when tokens are picked greedily (temperature 0; top-k, top-p and the seed are unused)."""
        return self.temperature == 0.0

    def sampling_config(self, seed: int, *, index: int = 0) -> "SamplingConfig":
        """The device sampler's :class:`~ninfer_kv.models.decoder.sampling.SamplingConfig` for one completion.

        Args:
          seed: the seed to use when :attr:`seed` is ``None`` (the engine's pick for this completion),
            an integer in ``[0, SEED_LIMIT)``.
          index: the completion's index in ``[0, n)``; with a request :attr:`seed`, completion ``i``
            is seeded with ``(seed + i) % SEED_LIMIT`` (as vLLM seeds its parallel samples), so the
            ``n`` completions differ and each is reproducible.
        Raises:
          TypeError, ValueError: ``seed`` or ``index`` out of range.
        """
        from ninfer_kv.models.decoder.sampling import SamplingConfig

        index = _int("index", index, 0, self.n - 1, f" (a completion of the n={self.n})")
        if self.seed is None:
            chosen = _int("seed", seed, 0, SEED_LIMIT - 1)
        else:
            chosen = (self.seed + index) % SEED_LIMIT
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=chosen)
