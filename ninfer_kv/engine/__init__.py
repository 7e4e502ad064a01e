"""The serving engine: many requests over one paged KV store, with vLLM's names.

* :class:`LLM` (:mod:`.llm`) — offline ``generate(prompts, sampling_params)`` and ``chat(messages)``
  over a Hugging Face checkpoint directory or any :class:`EngineModel`;
* :class:`AsyncLLMEngine` (:mod:`.async_engine`) — ``generate(...)`` as an async iterator of outputs,
  ``abort(request_id)``, for servers;
* :class:`EngineCore` (:mod:`.core`) — the request queue, admission by entitlement, token-granular
  prefix reuse (:mod:`.prefix_cache` over :mod:`.prefix_index`), continuous batching of prefill
  chunks and decodes;
* :class:`EngineModel` / :class:`DecoderModel` (:mod:`.model`) — the protocol a model implements;
* :class:`SamplingParams`, :class:`RequestOutput`, :class:`CompletionOutput`, :class:`Logprob`
  (:mod:`.sampling_params`, :mod:`.outputs`); text through :mod:`.detokenize` (incremental
  detokenization, stop strings) and :class:`ChatTemplate` (:mod:`.chat_template`, jinja2's sandbox).

docs/ENGINE.md describes the policies.
"""

from .async_engine import AsyncLLMEngine
from .chat_template import ChatTemplate, ChatTemplateError
from .core import EngineCore, EngineStats
from .llm import LLM, RequestFailedError
from .model import DecoderModel, EngineModel, StepOutput
from .outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "EngineCore",
    "EngineStats",
    "EngineModel",
    "DecoderModel",
    "StepOutput",
    "RequestFailedError",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "FINISH_STOP",
    "FINISH_LENGTH",
    "FINISH_ABORT",
    "FINISH_REASONS",
    "ChatTemplate",
    "ChatTemplateError",
]
