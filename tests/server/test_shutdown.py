"""SIGTERM while streams run: the server stops accepting connections, lets running requests finish
for ``--shutdown-grace`` seconds, aborts the rest, and exits with status 0, and no client hangs.

A fresh server (``--shutdown-grace 2``) serves three long streams (4,000 tokens each, far more than
two seconds of work) and two short ones (30 tokens, started just before the signal).  After SIGTERM
a new connection must be refused (or answered 503); the short streams, which need well under the
grace period, must complete (``finish_reason`` "length", every token); the long ones must end with
``finish_reason`` "abort" (the server aborts them when the grace period is over, and their streams
close normally); and the process must exit 0 within the grace period plus a margin.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .server_fixtures import ServerProcess, async_openai_client, httpx  # noqa: E402

MODEL = "tiny-llama"
GRACE = 2.0
MARGIN = 15.0
"""Seconds the process may take to exit beyond the grace period (a few normally)."""

LONG, SHORT = 4000, 30
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "4096", "--max-num-seqs", "5", "--kv-capacity",
         str(5 * 4096), "--shutdown-grace", str(GRACE))


async def consume(client, prompt: str, max_tokens: int, started: asyncio.Event) -> dict:
    """Read one stream to its end; what it got and how it ended."""
    got = {"text": "", "finish_reason": None, "error": None}
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                got["text"] += c.text
                got["finish_reason"] = c.finish_reason or got["finish_reason"]
            started.set()
    except Exception as e:  # noqa: BLE001 - a connection cut by the shutdown is one way to end
        got["error"] = f"{type(e).__name__}: {e}"
    finally:
        started.set()
    return got


async def new_request_outcome(server) -> str:
    """What a new connection gets once the server is shutting down."""
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as fresh:
            r = await fresh.post(server.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": "too late", "max_tokens": 1})
            return f"status {r.status_code}"
    except httpx.TransportError as e:
        return f"refused ({type(e).__name__})"


async def wait_exit(server, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)
    return time.monotonic()


async def scenario(server):
    client = async_openai_client(server, timeout=GRACE + MARGIN + 30)
    try:
        events = [asyncio.Event() for _ in range(5)]
        tasks = [asyncio.create_task(consume(client, f"Long stream {i}: ", LONG, events[i])) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[:3])), 60)
        tasks += [asyncio.create_task(consume(client, f"Short stream {i}: ", SHORT, events[3 + i])) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[3:])), 60)

        signalled = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        await asyncio.sleep(0.5)
        late = await new_request_outcome(server)
        done, pending = await asyncio.wait(tasks, timeout=GRACE + MARGIN)
        for t in pending:
            t.cancel()
        exited = await wait_exit(server, GRACE + MARGIN - (time.monotonic() - signalled))
        return signalled, late, [t.result() if t in done else None for t in tasks], exited
    finally:
        await client.close()


def test_sigterm_finishes_short_streams_aborts_long_ones_and_exits_0(text_checkpoint, tmp_path):
    server = ServerProcess(text_checkpoint, *FLAGS, log_dir=tmp_path)
    server.start()
    try:
        signalled, late, results, exited = asyncio.run(scenario(server))
    finally:
        server.kill()
    log = server.describe()
    assert exited is not None, f"the server did not exit within {GRACE + MARGIN:.0f} s of SIGTERM\n{log}"
    assert all(r is not None for r in results), f"a stream hung after SIGTERM: {results}\n{log}"
    assert server.proc.returncode == 0, f"exit status {server.proc.returncode} after SIGTERM (0 expected)\n{log}"
    assert exited - signalled <= GRACE + MARGIN
    assert late.startswith("refused") or late == "status 503", f"a new request after SIGTERM got {late}"
    for r in results[3:]:  # short: finished within the grace period
        assert r["finish_reason"] == "length" and len(r["text"]) == SHORT and r["error"] is None, r
    for r in results[:3]:  # long: aborted when the grace period is over, the stream closed normally
        assert len(r["text"]) < LONG, r
        assert r["finish_reason"] == "abort" and r["error"] is None, r
