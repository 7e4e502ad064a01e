"""From checked requests to engine requests, and from engine outputs to OpenAI bodies.

:func:`run` submits one engine request per prompt (``n`` completions each) to the
:class:`~ninfer_kv.engine.AsyncLLMEngine` and merges their output streams; leaving it early (a
client that disconnected, a cancelled handler) cancels every engine request it started, which
frees their rows at the next round.  :class:`Tracker` turns cumulative outputs into per-choice
deltas and records the latency metrics.  The builders shape completions and chat bodies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from ..engine import AsyncLLMEngine, RequestOutput, SamplingParams
from .metrics import ServerMetrics
from .protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = ["Prompt", "run", "Tracker", "completion_logprobs", "chat_logprobs", "usage"]


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its text (``None`` for token ids) and token ids."""

    text: str | None
    ids: list[int]


async def run(engine: AsyncLLMEngine, request_id: str, prompts: list[Prompt],
              params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt index, cumulative output)`` of every prompt's engine request as they arrive;
    an engine refusal (raised before any output) propagates."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, prompt: Prompt) -> None:
        try:
            source = {"prompt": prompt.text, "prompt_token_ids": prompt.ids}
            async for out in engine.generate(source, params, request_id=f"{request_id}-{i}"):
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Tracker:
    """Per-choice progress of one HTTP request: what was already sent, and the latency metrics.

    ``arrival`` is when the request arrived (``time.monotonic()``)."""

    def __init__(self, metrics: ServerMetrics, n: int, arrival: float):
        self.metrics = metrics
        self.n = n
        self.arrival = arrival
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.last_time: dict[int, float] = {}
        self.finished: set[int] = set()
        self.done_prompts: set[int] = set()
        self.first_token = False

    def index(self, prompt: int, completion: int) -> int:
        return prompt * self.n + completion

    def advance(self, prompt: int, out: RequestOutput):
        """Yield ``(choice index, completion, new text, first new token, finish reason or None)`` for
        every completion of ``out`` with something new to send."""
        now = time.monotonic()
        for c in out.outputs:
            k = self.index(prompt, c.index)
            tokens = len(c.token_ids)
            new_tokens = tokens - self.sent_tokens.get(k, 0)
            if new_tokens > 0:
                if not self.first_token:
                    self.first_token = True
                    self.metrics.ttft.observe(now - self.arrival)
                if k in self.last_time:
                    gap = (now - self.last_time[k]) / new_tokens
                    for _ in range(new_tokens):
                        self.metrics.itl.observe(gap)
                self.last_time[k] = now
                self.metrics.generation_tokens.inc(new_tokens)
            text = c.text[self.sent_text.get(k, 0):]
            finish = c.finish_reason if c.finish_reason is not None and k not in self.finished else None
            first = self.sent_tokens.get(k, 0)
            if text or finish or new_tokens > 0:
                self.sent_text[k] = len(c.text)
                self.sent_tokens[k] = tokens
                if finish is not None:
                    self.finished.add(k)
                yield k, c, text, first, finish
        if out.finished and prompt not in self.done_prompts:
            self.done_prompts.add(prompt)
            self.metrics.finished(len(out.prompt_token_ids), out.num_cached_tokens,
                                  [c.finish_reason for c in out.outputs])

    def close(self, prompts: list[Prompt]) -> None:
        """The HTTP request ended: prompts whose final output never arrived (the client left, the
        server shut down) count as aborted."""
        for i, p in enumerate(prompts):
            if i not in self.done_prompts:
                self.done_prompts.add(i)
                self.metrics.finished(len(p.ids), 0, ["abort"] * self.n)


def _top(entry: dict, chosen: int, k: int) -> list:
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, kv[0]))
    return [(t, lp) for t, lp in ranked if t == chosen or (lp.rank is not None and lp.rank <= k)][: max(k, 1)]


def _text(lp, token: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"<{token}>"


def completion_logprobs(completion, start: int, k: int, offset: int) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` of tokens ``[start, ...)`` of ``completion`` (``k`` top
    alternatives each); text offsets count from ``offset``."""
    out = CompletionLogprobs()
    for token, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:]):
        lp = entry[token]
        out.tokens.append(_text(lp, token))
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({_text(e, t): e.logprob for t, e in _top(entry, token, k)} if k else None)
        out.text_offset.append(offset)
        offset += len(out.tokens[-1])
    return out


def chat_logprobs(completion, start: int, k: int) -> ChoiceLogprobs:
    """The chat ``logprobs.content`` of tokens ``[start, ...)`` of ``completion``."""
    content = []
    for token, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:]):
        lp = entry[token]
        text = _text(lp, token)
        top = [TopLogprob(token=_text(e, t), logprob=e.logprob, bytes=list(_text(e, t).encode()))
               for t, e in _top(entry, token, k)] if k else []
        content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """The ``usage`` object (``prompt_tokens_details.cached_tokens``: prompt tokens reused from the prefix cache)."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
