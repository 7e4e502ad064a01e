"""Checks of a generation request's arguments, shared by the generator's verbs: token ids,
output budgets, sampling configs, callbacks.  Each raises ``TypeError`` (a wrong kind of value) or
``ValueError`` (out of range) naming the argument, the value and what is allowed; none changes
anything."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..planning import MAX_CONTEXT
from .decoder.sampling import SamplingConfig

__all__ = ["MAX_NEW_TOKENS", "token_ids", "check_max_new_tokens", "check_sampling", "check_callback"]

MAX_NEW_TOKENS = MAX_CONTEXT
"""Largest ``max_new_tokens`` a request may ask for (the int32 position ceiling; the budget is
clipped to the context anyway)."""


def token_ids(name: str, values, vocab: int) -> list[int]:
    """``values`` as a list of ints in ``[0, vocab)``; ``TypeError`` / ``ValueError`` naming the first bad item."""
    allowed = f"token ids are integers in [0, {vocab})"
    if isinstance(values, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a list of token ids, got a {type(values).__name__} ({values!r:.40}); {allowed}")
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise TypeError(f"{name} must be one-dimensional, got an array of shape {values.shape}; {allowed}")
        if np.issubdtype(values.dtype, np.integer):
            bad = np.flatnonzero((values < 0) | (values >= vocab))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"{name}[{i}]={int(values[i])} is outside the vocabulary [0, {vocab})")
            return [int(t) for t in values.tolist()]
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of token ids, got {type(values).__name__}; {allowed}") from None
    out = []
    for i, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{name}[{i}]={t!r} is not a token id; {allowed}")
        if not 0 <= t < vocab:
            raise ValueError(f"{name}[{i}]={int(t)} is outside the vocabulary [0, {vocab})")
        out.append(int(t))
    return out


def check_max_new_tokens(value) -> None:
    """``value`` is an integer in ``[1, MAX_NEW_TOKENS]`` (bool refused)."""
    allowed = f"an integer in [1, {MAX_NEW_TOKENS}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_new_tokens={value!r} is invalid; it must be {allowed}")
    if not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens={value!r} is invalid; it must be {allowed}")


def check_sampling(name: str, sampling) -> None:
    """``sampling`` is a :class:`SamplingConfig` whose values (re)pass its own checks."""
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"{name} must be a SamplingConfig, got {type(sampling).__name__}")
    dataclasses.replace(sampling)  # runs the checks of SamplingConfig again (values set after construction)


def check_callback(on_token) -> None:
    """``on_token`` is ``None`` or callable."""
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be a function f(sequence, token) or None, got {type(on_token).__name__}")
