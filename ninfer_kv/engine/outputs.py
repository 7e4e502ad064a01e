"""What a request returns: :class:`RequestOutput` holding one :class:`CompletionOutput` per sample.

The names, fields and meanings are vLLM's.  Both are plain mutable dataclasses: a streaming engine
updates the same objects as tokens arrive.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = [
    "Logprob",
    "SampleLogprobs",
    "CompletionOutput",
    "RequestOutput",
    "FINISH_STOP",
    "FINISH_LENGTH",
    "FINISH_ABORT",
    "FINISH_REASONS",
]

FINISH_STOP = "stop"
"""A completion ended by an end-of-sequence token, a stop token id or a stop string."""

FINISH_LENGTH = "length"
"""A completion ended by ``max_tokens`` or by the model's context."""

FINISH_ABORT = "abort"
"""A completion ended because its request was cancelled."""

FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)
"""Every ``finish_reason`` of a finished completion."""


@dataclasses.dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``).

    Attributes:
      logprob: natural log of the token's probability under the distribution the token was drawn
        from (``-inf`` for a token that could not be drawn).
      rank: the token's rank in that distribution, ``1`` for the most likely (``None``: not known).
      decoded_token: the token's text on its own (``None``: not decoded).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Log-probabilities of a completion: one dict per generated token, token id -> :class:`Logprob`."""


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``).

    Attributes:
      index: the completion's index among the request's ``n``, in ``[0, n)``.
      text: the generated text so far (a stop string that ended it is not included).
      token_ids: the generated token ids so far (an end-of-sequence or stop token that ended it is
        included; its text is not).
      logprobs: ``None`` unless the request asked for ``logprobs``; then a list with one dict per
        generated token mapping token id -> :class:`Logprob`: the requested number of most likely
        alternatives and, always, the chosen token.
      finish_reason: ``None`` while the completion runs, then one of :data:`FINISH_REASONS`:
        ``"stop"`` (an end-of-sequence token, a stop token id or a stop string), ``"length"``
        (``max_tokens`` or the model's context) or ``"abort"`` (cancelled).
      stop_reason: the stop string (a str) or stop token id (an int) that ended the completion;
        ``None`` when it ended by an end-of-sequence token or by length, or still runs.
      cumulative_logprob: the sum of the chosen tokens' log-probabilities, when computed.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def __post_init__(self):
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r} is invalid; it must be None or one of {FINISH_REASONS}")

    def finished(self) -> bool:
        """``True`` once the completion has ended (it has a ``finish_reason``)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What one request has produced so far (vLLM's ``RequestOutput``).

    Attributes:
      request_id: the request's id.
      prompt: the prompt text, or ``None`` when the request gave token ids.
      prompt_token_ids: the prompt's token ids (after templating and tokenization).
      outputs: the request's completions, one per sample, ordered by :attr:`CompletionOutput.index`.
      finished: ``True`` once every completion has ended.
      num_cached_tokens: prompt tokens whose KV was reused instead of computed for this request: its
        longest cached prefix, or a prefix computed once for several requests (docs/ENGINE.md).
      error: why the request failed (a model step raised while serving it), else ``None``; its
        completions then end with finish reason ``"abort"``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
