"""The OpenAI-compatible application: :func:`create_app` over an :class:`~ninfer_kv.engine.AsyncLLMEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
through ``sse-starlette`` when ``stream`` is set), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (:mod:`.metrics`) and ``POST /reset_prefix_cache``.  Every request first passes
the :mod:`.guard` (API key, body size); refusals have the OpenAI error shape (:mod:`.errors`).

A request is checked whole before anything is queued: the model name, fields the engine cannot
honour, the sampling values (:class:`~ninfer_kv.engine.SamplingParams`), every prompt against the
context (prompt shorter than ``max_model_len``, prompt + ``max_tokens`` within it).  A client that
disconnects — mid-stream, or while waiting for a non-streamed answer — cancels its engine requests,
whose rows and reservations are freed at the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import anyio

from fastapi import FastAPI, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from ..engine import AsyncLLMEngine, SamplingParams
from .errors import APIError, install, param_of
from .generation import Prompt, Tracker, chat_logprobs, completion_logprobs, run, usage
from .guard import RequestGuard
from .limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_GRACE
from prometheus_client import CONTENT_TYPE_LATEST

from .metrics import ServerMetrics
from .protocol import (
    MAX_PROMPTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
)

__all__ = ["create_app"]

_DISCONNECT_POLL = 0.25


class _Server:
    """The routes' shared state: the engine, the served name, the metrics."""

    def __init__(self, engine: AsyncLLMEngine, name: str, shutdown_grace: float):
        self.engine = engine
        self.llm = engine.llm
        self.name = name
        self.max_model_len = engine.engine.max_model_len
        self.metrics = ServerMetrics()
        self.grace = float(shutdown_grace)
        self.created = int(time.time())

    # -- checks ----------------------------------------------------------------------------------------
    def check_common(self, req) -> None:
        if req.model != self.name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"{bad[0]} is not supported by this server (leave it unset)", param=bad[0],
                           code="unsupported_parameter")

    def sampling(self, req, max_tokens: int | None, logprobs: int | None,
                 max_tokens_field: str = "max_tokens") -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                logprobs=logprobs,
            )
        except (ValueError, TypeError) as exc:
            message, param = str(exc), param_of(str(exc))
            if param == "max_tokens" and max_tokens_field != param:
                message, param = max_tokens_field + message[len(param):], max_tokens_field
            raise APIError(400, message, param=param, code="invalid_value") from None

    def check_lengths(self, prompts: list[Prompt], max_tokens: int | None, where: str,
                      max_tokens_field: str = "max_tokens") -> None:
        for p in prompts:
            if not p.ids:
                raise APIError(400, f"{where} is empty; it must hold at least one token", param=where)
            if len(p.ids) >= self.max_model_len:
                raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the "
                                    f"{where} has {len(p.ids)} (allowed: at most {self.max_model_len - 1})",
                               param=where, code="context_length_exceeded")
            if max_tokens is not None and len(p.ids) + max_tokens > self.max_model_len:
                raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; "
                                    f"{len(p.ids)} in the {where} plus {max_tokens_field}={max_tokens} exceed it "
                                    f"(allowed: {max_tokens_field} <= {self.max_model_len - len(p.ids)})",
                               param=max_tokens_field, code="context_length_exceeded")

    def encode(self, prompt, where: str) -> Prompt:
        try:
            text, ids = self.llm.encode(prompt, where)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=where) from None
        return Prompt(text, list(ids))

    # -- running -----------------------------------------------------------------------------------------
    async def collect(self, request: Request, rid: str, prompts: list[Prompt], params: SamplingParams,
                      tracker: Tracker) -> dict:
        """Run to completion (non-streamed); a disconnected client cancels it."""

        async def consume():
            finals = {}
            async for i, out in self.guarded(run(self.engine, rid, prompts, params)):
                for _ in tracker.advance(i, out):
                    pass
                if out.finished:
                    finals[i] = out
            return finals

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise APIError(400, "the client disconnected", code="client_disconnected")
        finally:
            if not task.done():  # the client left, or the server is shutting down: abort
                task.cancel()
            tracker.close(prompts)

    async def guarded(self, outputs):
        """Engine refusals as 400s, failed steps as 500s."""
        try:
            async for i, out in outputs:
                if out.finished and out.error is not None:
                    raise APIError(500, f"the model step serving this request failed: {out.error}",
                                   code="engine_error")
                yield i, out
        except (ValueError, TypeError) as exc:
            param = param_of(str(exc))
            raise APIError(400, str(exc), param="prompt" if param == "prompt_token_ids" else param,
                           code="invalid_value") from None
        finally:
            await outputs.aclose()

    async def stream(self, rid: str, prompts: list[Prompt], params: SamplingParams, tracker: Tracker, chunk,
                     final_usage) -> EventSourceResponse:
        """Start the engine requests (refusals still raise here, as errors with a status), then
        stream ``chunk(index, completion, text, start, finish)`` events, the usage chunk when
        asked, and ``[DONE]``."""
        outputs = self.guarded(run(self.engine, rid, prompts, params))
        try:
            first = await outputs.__anext__()
        except BaseException:
            await outputs.aclose()
            raise

        shutdown = anyio.Event()  # set by sse-starlette when the server begins to shut down

        async def abort_after_grace():
            await shutdown.wait()
            await asyncio.sleep(self.grace)
            for i in range(len(prompts)):  # their streams end with finish_reason "abort" and [DONE]
                await self.engine.abort(f"{rid}-{i}")

        async def events():
            finals = {}
            watcher = asyncio.create_task(abort_after_grace())
            try:
                item = first
                while True:
                    i, out = item
                    if out.finished:
                        finals[i] = out
                    for k, c, text, start, finish in tracker.advance(i, out):
                        yield {"data": chunk(k, c, text, start, finish).model_dump_json()}
                    try:
                        item = await outputs.__anext__()
                    except StopAsyncIteration:
                        break
                if final_usage is not None:
                    yield {"data": final_usage(finals).model_dump_json()}
            except APIError as exc:  # a step failed mid-stream: say so in the stream, then end it
                body = ErrorResponse(error=ErrorBody(message=exc.message, type="internal_error", param=exc.param,
                                                     code=exc.code))
                yield {"data": body.model_dump_json()}
            finally:
                watcher.cancel()
                tracker.close(prompts)
                await outputs.aclose()
            yield {"data": "[DONE]"}

        # after the grace period the engine aborts the requests; the margin lets that round end them
        return EventSourceResponse(events(), shutdown_event=shutdown, shutdown_grace_period=self.grace + 5.0)


def _totals(finals: dict) -> tuple[int, int, int]:
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals.values())
    return prompt, completion, cached


def _usage_chunk(req, chunk_type, rid: str, created: int, name: str):
    """The last chunk of a stream that asked for usage (``stream_options.include_usage``): no
    choices, the request's usage; ``None`` when it did not ask."""
    if req.stream_options is None or not req.stream_options.include_usage:
        return None
    return lambda finals: chunk_type(id=rid, created=created, model=name, choices=[], usage=usage(*_totals(finals)))


def _completion_prompts(server: _Server, prompt) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty; give a string, token ids, or a list of them", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} are allowed", param="prompt")
    return [server.encode(p, "prompt") for p in items]


def create_app(engine: AsyncLLMEngine, *, served_model_name: str, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE) -> FastAPI:
    """The application serving ``engine`` under ``served_model_name`` (module docstring).

    Args:
      engine: the engine (its :class:`~ninfer_kv.engine.LLM` encodes prompts and renders chats).
      served_model_name: the ``model`` requests must name.
      api_key: the bearer token every route but ``/health`` requires (``None``: open).
      max_request_bytes: the largest request body.
      shutdown_grace: seconds a stream may run on after shutdown begins.
    """
    server = _Server(engine, served_model_name, shutdown_grace)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, lambda: engine.shutdown(abort=True))

    app = FastAPI(title="ninfer-kv", lifespan=lifespan)
    app.state.server = server
    install(app)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_request_bytes)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=server.name, created=server.created, max_model_len=server.max_model_len)])

    @app.get("/metrics")
    async def metrics():
        server.metrics.refresh(await engine.stats())
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"released": await engine.clear_cache()}

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest, request: Request):
        arrival = time.monotonic()
        server.check_common(req)
        params = server.sampling(req, req.max_tokens, req.logprobs)
        prompts = _completion_prompts(server, req.prompt)
        server.check_lengths(prompts, req.max_tokens, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        tracker = Tracker(server.metrics, req.n, arrival)
        k = req.logprobs or 0
        if req.stream:
            offsets: dict[int, int] = {}

            def chunk(index, c, text, start, finish):
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(c, start, k, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp.tokens)
                return CompletionChunk(id=rid, created=created, model=server.name, choices=[
                    CompletionChunkChoice(index=index, text=text, logprobs=lp, finish_reason=finish)])

            final = _usage_chunk(req, CompletionChunk, rid, created, server.name)
            return await server.stream(rid, prompts, params, tracker, chunk, final)
        finals = await server.collect(request, rid, prompts, params, tracker)
        choices = [
            CompletionChoice(index=tracker.index(i, c.index), text=c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=completion_logprobs(c, 0, k, 0) if req.logprobs is not None else None)
            for i, out in sorted(finals.items()) for c in out.outputs
        ]
        return CompletionResponse(id=rid, created=created, model=server.name, choices=choices,
                                  usage=usage(*_totals(finals)))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        server.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else 0
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = server.sampling(req, max_tokens, k if req.logprobs else None, field)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text, ids = server.llm.render_chat(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render this conversation
            raise APIError(400, f"the chat template could not render these messages: {exc}",
                           param="messages") from None
        prompts = [Prompt(text, list(ids))]
        server.check_lengths(prompts, max_tokens, "messages", field)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tracker = Tracker(server.metrics, req.n, arrival)
        if req.stream:
            started: set[int] = set()

            def chunk(index, c, text, start, finish):
                role = None if index in started else "assistant"
                started.add(index)
                lp = chat_logprobs(c, start, k) if req.logprobs else None
                return ChatCompletionChunk(id=rid, created=created, model=server.name, choices=[
                    ChatChunkChoice(index=index, delta=Delta(role=role, content=text), logprobs=lp,
                                    finish_reason=finish)])

            final = _usage_chunk(req, ChatCompletionChunk, rid, created, server.name)
            return await server.stream(rid, prompts, params, tracker, chunk, final)
        finals = await server.collect(request, rid, prompts, params, tracker)
        choices = [
            ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason, logprobs=chat_logprobs(c, 0, k) if req.logprobs else None)
            for out in finals.values() for c in out.outputs
        ]
        return ChatCompletionResponse(id=rid, created=created, model=server.name, choices=choices,
                                      usage=usage(*_totals(finals)))

    return app
