"""Calibrate the MTP head of a random-weights demo model into a useful drafter.

With random weights the MTP head's guesses agree with the main model about once per vocabulary
size, so speculative decoding would reject every draft.  A trained MTP head predicts the token
after next; this module gets a usable drafter in a few seconds by ridge regression, touching only
the MTP head (the main model, hence every served token, is unchanged).

The head computes ``x_i = concat(norm(embed(t_{i+1})), norm(h_i)) @ proj``, then one decoder layer
``g_i = x_i + branches(x_i)`` and ``logits_i = lm_head(norm(g_i))``; the main model's next hidden
state ``h_{i+1}`` gives ``t_{i+2} = argmax lm_head(final_norm(h_{i+1}))``.  So the fit

1. ties the head's final norm to the main model's;
2. solves ``proj`` so that ``x_i ≈ h_{i+1}`` over a calibration set, then solves it once more for
   ``x_i ≈ h_{i+1} - branches(x_i)``, with the decoder layer's residual branches (its attention
   over the MTP KV and its MLP) measured at the first solution.

The calibration set is random token sequences run through the dense reference.  On the demo
models roughly half of the first drafts match the main model's greedy token on its own
continuations (the served acceptance rate is reported by every MTP run).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..models.decoder import ModelConfig, dense_mtp_forward, init_params
from ..models.decoder.dense import dense_forward
from ..models.decoder.mtp import mtp_input

__all__ = ["CalibratedHead", "fit_mtp_head", "demo_params", "CALIBRATION_SHAPE", "RIDGE"]

CALIBRATION_SHAPE = (16, 256)
"""(sequences, tokens) of random calibration text."""

RIDGE = 1e-3
"""Ridge strength relative to the mean diagonal of ``XᵀX``."""


@dataclasses.dataclass(frozen=True)
class CalibratedHead:
    """Parameters with a fitted MTP head and the fit's agreement on its calibration set.

    Attributes:
      params: the model parameters; only ``params["mtp"]["proj"]`` and
        ``params["mtp"]["final_norm"]`` differ from the input.
      agreement: fraction of calibration pairs where the head's argmax equals the main model's
        greedy token after next.
    """

    params: dict
    agreement: float


@functools.partial(jax.jit, static_argnames=("model",))
def _pairs(params: dict, seq: jax.Array, *, model: ModelConfig):
    """Pairs ``(h_i, t_{i+1})``, the head's input features ``concat(norm(embed(t_{i+1})), norm(h_i))``
    (the projection's input) and the regression target ``h_{i+1}``."""
    hidden = dense_forward(params, model, seq)
    h_in, t_next = hidden[:, :-1], seq[:, 1:]
    eye = dict(params, mtp=dict(params["mtp"], proj=jnp.eye(2 * model.d_model, dtype=hidden.dtype)))
    features = mtp_input(eye, model, h_in, t_next)  # concat(norm(embed(t_{i+1})), norm(h_i))
    return h_in, t_next, features, hidden[:, 1:]


@functools.partial(jax.jit, static_argnames=("model",))
def _branches(params: dict, h_in, t_next, *, model: ModelConfig):
    """``g_i - x_i`` (the MTP decoder layer's residual branches) and the head's logits."""
    g, logits = dense_mtp_forward(params, model, h_in, t_next)
    return g - mtp_input(params, model, h_in, t_next), logits


def _ridge(x: np.ndarray, y: np.ndarray, dtype) -> jax.Array:
    a = x.T @ x
    a[np.diag_indices_from(a)] += RIDGE * float(np.trace(a)) / a.shape[0]
    return jnp.asarray(np.linalg.solve(a, x.T @ y), dtype)


def fit_mtp_head(params: dict, model: ModelConfig, seed: int = 0) -> CalibratedHead:
    """Fit the MTP head of ``params`` (see the module docstring); ``seed`` draws the calibration text."""
    if not model.mtp or "mtp" not in params:
        raise ValueError("the model has no MTP head (ModelConfig(mtp=True))")
    rng = np.random.default_rng([seed, 0xD12AF7])
    seq = jnp.asarray(rng.integers(1, model.vocab_size, CALIBRATION_SHAPE), jnp.int32)
    h_in, t_next, features, target = _pairs(params, seq, model=model)
    d = model.d_model
    x = np.asarray(features, np.float64).reshape(-1, 2 * d)
    y = np.asarray(target, np.float64).reshape(-1, d)
    fitted = dict(params, mtp=dict(params["mtp"], final_norm=params["final_norm"], proj=_ridge(x, y, model.jnp_dtype)))
    branches, _ = _branches(fitted, h_in, t_next, model=model)
    proj = _ridge(x, y - np.asarray(branches, np.float64).reshape(-1, d), model.jnp_dtype)
    fitted = dict(params, mtp=dict(fitted["mtp"], proj=proj))
    _, logits = _branches(fitted, h_in, t_next, model=model)
    guess = np.asarray(jnp.argmax(logits, axis=-1))  # the head's guess for t_{i+2}
    truth = np.asarray(jnp.argmax(_main_logits(params, target, model=model), axis=-1))  # main: from h_{i+1}
    return CalibratedHead(fitted, float(np.mean(guess == truth)))


@functools.partial(jax.jit, static_argnames=("model",))
def _main_logits(params: dict, hidden, *, model: ModelConfig):
    from ..models.decoder.model import logits_from_hidden

    return logits_from_hidden(params, model, hidden)


@functools.lru_cache(maxsize=4)
def demo_params(model: ModelConfig, seed: int) -> tuple[dict, float | None]:
    """A demo model's parameters from ``seed``; with an MTP head, the head fitted as a drafter by
    :func:`fit_mtp_head` (and its calibration agreement, else ``None``)."""
    params = init_params(model, seed)
    if not model.mtp:
        return params, None
    head = fit_mtp_head(params, model, seed)
    return head.params, head.agreement
