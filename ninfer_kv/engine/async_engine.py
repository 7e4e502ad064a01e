"""``AsyncLLMEngine``: the engine for asyncio programs (servers), with vLLM's names.

::

    engine = AsyncLLMEngine(LLM(model=DIR, max_num_seqs=32))
    async for out in engine.generate("The paged KV cache", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)      # cumulative: everything so far
    await engine.abort("r2")            # ends r2 at the next round; its stream ends with finish_reason "abort"

One thread runs the engine's rounds while any request is unfinished and sleeps otherwise; every
call into the engine (adding, aborting, stepping) runs on that thread, so the event loop never
blocks on a model step and the engine needs no lock.  Each request's outputs reach its own
``asyncio.Queue``; leaving the ``async for`` early (a client that disconnects) aborts the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
from typing import AsyncIterator

from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine"]


class AsyncLLMEngine:
    """Serves an :class:`LLM`'s engine to asyncio tasks (module docstring).

    Args:
      llm: the engine to serve (its ``generate`` must not be called while this serves it).
    """

    def __init__(self, llm: LLM):
        if not isinstance(llm, LLM):
            raise TypeError(f"llm must be an LLM, got {type(llm).__name__}")
        self.llm = llm
        self.engine = llm.engine
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ninfer-engine")
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._running = False
        self._closed = False
        self._ids = 0

    # -- requests -----------------------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit ``prompt`` (text, token ids or a prompt dict, as :meth:`LLM.generate` takes) and
        yield its cumulative :class:`RequestOutput` as tokens arrive, the last one ``finished``.

        A bad prompt or parameter raises here, before anything is queued."""
        if self._closed:
            raise RuntimeError("this AsyncLLMEngine was shut down")
        if request_id is None:
            request_id = f"async-{self._next_id()}"
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, tokens = self.llm._encode(prompt, "prompt")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
            self._streams[request_id] = (loop, queue)
        try:
            await loop.run_in_executor(self._executor, self._add, request_id, tokens, params, text)
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer left early: free the request's row at the next round
                self._abort_soon(request_id)

    async def abort(self, request_id: str) -> bool:
        """End ``request_id`` at the next round (its stream ends with finish reason ``"abort"``);
        ``False`` when no unfinished request has that id."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._abort, request_id)

    def _abort_soon(self, request_id: str) -> None:
        """Queue an abort on the engine thread without waiting for it: a consumer that leaves
        because it was cancelled cannot await (its awaits are cancelled too, and a cancelled
        ``run_in_executor`` withdraws a call that has not started)."""
        with contextlib.suppress(RuntimeError):  # shut down: the engine aborts everything anyway
            self._executor.submit(self._abort, request_id)

    def _next_id(self) -> int:
        with self._lock:
            self._ids += 1
            return self._ids

    # -- the engine thread ------------------------------------------------------------------------------------------
    def _add(self, request_id, tokens, params, text) -> None:
        self.engine.add_request(request_id, tokens, params, prompt=text)
        self._kick()

    def _abort(self, request_id: str) -> bool:
        found = self.engine.abort(request_id)
        if found:
            self._kick()
        return found

    def _kick(self) -> None:
        """On the engine thread: make sure a round loop is scheduled."""
        if not self._running:
            self._running = True
            self._executor.submit(self._rounds)

    def _rounds(self) -> None:
        """On the engine thread: one round, then yield the thread to queued calls and continue
        (after :meth:`shutdown` began, the remaining rounds run here, one after another)."""
        while True:
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - the engine's own bug: every stream learns of it
                self._running = False
                self._broadcast(exc)
                return
            for out in outputs:
                self._deliver(out.request_id, out, out.finished)
            if not self.engine.has_unfinished():
                self._running = False
                return
            try:
                self._executor.submit(self._rounds)  # behind the adds and aborts already queued
                return
            except RuntimeError:  # shutting down: no new tasks; finish here
                continue

    def _deliver(self, request_id: str, item, last: bool) -> None:
        with self._lock:
            target = self._streams.get(request_id)
            if target is not None and last:
                del self._streams[request_id]
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the stream's event loop is closed: nobody reads it, end the request
                with self._lock:
                    self._streams.pop(request_id, None)
                self.engine.abort(request_id)

    def _broadcast(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for loop, queue in streams.values():
            with contextlib.suppress(RuntimeError):  # a closed loop has no reader
                loop.call_soon_threadsafe(queue.put_nowait, exc)

    # -- state ------------------------------------------------------------------------------------------------------
    async def stats(self) -> dict:
        """Read on the engine thread: requests ``waiting`` and ``running``, the engine's counters
        (``stats``, ``cache``), ``pages`` per pool (``{pool: (used, capacity)}``, used = leased or
        reserved, cached prefixes included) and ``host_bytes`` (the Host tier's bytes in use, 0
        without one)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._stats)

    def _stats(self) -> dict:
        e = self.engine
        pages = {}
        for kind in e.store.pool_kinds:
            pool = e.store.pool(kind)
            pages[kind.value] = (pool.capacity - pool.available, pool.capacity)
        host = e.store.host_occupancy()
        return {"waiting": e.num_waiting, "running": e.num_running, "stats": dataclasses.replace(e.stats),
                "cache": dataclasses.replace(e.cache.stats), "pages": pages,
                "host_bytes": 0 if host is None else int(host.used_bytes)}

    async def clear_cache(self) -> int:
        """Release every cached prefix no running request uses (on the engine thread); returns how many."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.engine.clear_cache)

    def shutdown(self, *, abort: bool = True) -> None:
        """Stop serving: abort what is unfinished (or let it finish) and stop the engine thread."""
        self._closed = True
        if abort:
            for rid in list(self._streams):
                self._executor.submit(self._abort, rid)
        self._executor.shutdown(wait=True)
