"""Dense no-cache recomputation of every served request (the demo's ``dense_match``).

For a request with prompt ``p`` and generated tokens ``g_1 .. g_m`` the dense reference runs the
same model over ``p + g_1 .. g_{m-1}`` from position 0 with plain causal attention and the same
codec round trip applied to K/V (:func:`ninfer_kv.models.decoder.dense_logits`), and compares,
at every generated position ``j``, with what the engine reported (the log-probabilities of the
generated token and of its :data:`~ninfer_kv.demo.serve.DENSE_LOGPROBS` most likely alternatives,
public :class:`~ninfer_kv.engine.Logprob` values):

* the log-probabilities: ``max |served - dense| <= tol``;
* the greedy token: ``g_j == argmax(dense)``, or — a tie within ``tol`` — the dense logit of
  ``g_j`` is within ``tol`` of the dense maximum.  Each dense position sees the served tokens
  before it, so one such tie cannot cascade.

The tolerance is relative to the logits' scale: ``tol = tol(profile) * max(1, max |dense logit|)``
over the request.  Why a tolerance, and why per profile: the paged path computes K and V in prefill
chunks and decode steps, the reference over the whole sequence; the float32 results differ in the
last bits (different matmul shapes), and the codec then occasionally rounds the two to neighbouring
codes.  Codes are bit-identical for identical inputs (the ops' contract), so the difference is at
most one code step of a few elements, and its effect on the logits grows with the codec's step and
with the logits' magnitude: about ``2e-4`` for BF16, ``7e-4`` for INT8-G64 and a few ``1e-3`` for
the FP8 and NVFP4 codecs on the demo models (logits of order 1); a checkpoint's logits of order 10
to 30 move proportionally more.  :data:`DENSE_TOLERANCES` allows several times that.
``tokens_match`` reports exact greedy equality separately (always true for BF16 in practice).

Requests are recomputed in batches of :data:`DENSE_BATCH` rows padded to one length (causal
attention makes the padding invisible), so the reference compiles once per run.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..schema.geometry import PAGE_SIZE, ceil_div
from ..models.decoder import ModelConfig, dense_logits
from ..schema.profiles import KVProfile
from .serve import RequestRecord

__all__ = ["DenseCheck", "DENSE_TOLERANCES", "DENSE_BATCH", "check_dense", "tolerance_for"]

DENSE_TOLERANCES: dict[KVProfile, float] = {
    profile: max(profile.k_codec.spec.dense_tolerance, profile.v_codec.spec.dense_tolerance) for profile in KVProfile
}
"""Max absolute logit difference between served and dense logits, per KV profile (float32 model): the
largest ``dense_tolerance`` of its codecs' rows in :data:`~ninfer_kv.schema.profiles.CODEC_SPECS`."""

DENSE_BATCH = 8


@dataclasses.dataclass(frozen=True)
class DenseCheck:
    """Outcome of :func:`check_dense`.

    Attributes:
      match: every log-probability within the request's tolerance and every greedy token equal or
        tied within it.
      tokens_match: every greedy token exactly equal.
      tie_flips: positions where the served token differs from the dense argmax by a tie within
        the tolerance.
      max_abs_logprob_diff: over every reported log-probability of every request.
      max_relative_diff: the largest ``difference / max(1, logit scale)`` of a request (what
        ``tolerance`` bounds).
      logit_scale: the largest ``max |dense logit|`` of a request.
      tolerance: the profile's tolerance per unit of logit scale.
      checked_tokens: generated positions compared.
      mismatched_requests: ids of requests with a differing token or a difference out of tolerance.
    """

    match: bool
    tokens_match: bool
    tie_flips: int
    max_abs_logprob_diff: float
    max_relative_diff: float
    logit_scale: float
    tolerance: float
    checked_tokens: int
    mismatched_requests: tuple[int, ...]

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"mismatched_requests": list(self.mismatched_requests)}


def tolerance_for(profile) -> float:
    """The logit tolerance of ``profile`` (:data:`DENSE_TOLERANCES`)."""
    return DENSE_TOLERANCES[KVProfile.parse(profile)]


def dense_generation_logits(params: dict, model: ModelConfig, profile, records: Sequence[RequestRecord]):
    """Yield ``(record, dense logits (m, V))`` for each record with ``m > 0`` generated tokens.

    The dense (no-cache) model sees ``prompt + generated[:-1]``; row ``i`` of the logits is the
    prediction of ``generated[i]``.  Sequences run in batches of :data:`DENSE_BATCH`, padded at the
    end to a multiple of the page size (causal attention: padding is invisible).
    """
    work = [r for r in records if r.generated.size]
    if not work:
        return
    longest = max(r.request.prompt_tokens + r.generated.size - 1 for r in work)
    length = ceil_div(longest, PAGE_SIZE) * PAGE_SIZE
    for start in range(0, len(work), DENSE_BATCH):
        group = work[start : start + DENSE_BATCH]
        seqs = np.zeros((DENSE_BATCH, length), np.int32)
        for i, r in enumerate(group):
            full = np.concatenate([r.request.prompt, r.generated[:-1]])
            seqs[i, : full.size] = full
        logits = np.asarray(dense_logits(params, model, seqs, profile))
        for i, r in enumerate(group):
            n0 = r.request.prompt_tokens
            yield r, logits[i, n0 - 1 : n0 - 1 + r.generated.size]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def check_dense(
    params: dict,
    model: ModelConfig,
    profile,
    records: Sequence[RequestRecord],
    *,
    tolerance: float | None = None,
) -> DenseCheck:
    """Recompute every record densely and compare (see the module docstring).

    ``tolerance`` (per unit of logit scale) defaults to :func:`tolerance_for` ``(profile)``.
    """
    base = tolerance_for(profile) if tolerance is None else float(tolerance)
    max_diff = max_rel = top_scale = 0.0
    checked = ties = 0
    tokens_ok = True
    bad: list[int] = []
    for r, dense in dense_generation_logits(params, model, profile, records):
        m = r.generated.size
        scale = float(np.max(np.abs(dense)))
        tol = base * max(1.0, scale)
        differ = np.argmax(dense, axis=-1).astype(np.int32) != r.generated
        # a differing token is a tie when its dense logit is within tol of the dense maximum
        gap = dense.max(axis=-1) - np.take_along_axis(dense, r.generated[:, None].astype(np.int64), 1)[:, 0]
        untied = differ & ~(gap <= tol)
        logp = _log_softmax(dense)
        diff = 0.0
        for j, served in enumerate(r.logprobs):
            for token, value in served.items():
                diff = max(diff, abs(value - float(logp[j, token])))
        if not np.isfinite(diff):
            diff = float("inf")
        checked += m
        ties += int(np.sum(differ & (gap <= tol)))
        max_diff = max(max_diff, diff)
        max_rel = max(max_rel, diff / max(1.0, scale))
        top_scale = max(top_scale, scale)
        tokens_ok &= not differ.any()
        if untied.any() or not diff <= tol:
            bad.append(r.request.id)
    return DenseCheck(
        match=not bad,
        tokens_match=tokens_ok,
        tie_flips=ties,
        max_abs_logprob_diff=max_diff,
        max_relative_diff=max_rel,
        logit_scale=top_scale,
        tolerance=base,
        checked_tokens=checked,
        mismatched_requests=tuple(sorted(bad)),
    )
