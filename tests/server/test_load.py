"""64 concurrent streaming clients, a quarter of which hang up mid-stream.

Clients are ``AsyncOpenAI`` streams on 8 rows (most of them wait in the queue), greedy, over 16
prompts in 4 families that share long prefixes (so the prefix cache is shared while requests come
and go).  Every stream that is read to the end must be complete (``finish_reason`` "length", the
usage chunk) and equal, token for token, to the same request served alone afterwards without
streaming.  Then nothing may be left: no request running or waiting, and after
``/reset_prefix_cache`` no page of the Main pool in use (a disconnected client's row and pages are
released, not leaked); every request was counted once in ``ninfer_kv_requests_total``.
"""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .server_fixtures import (  # noqa: E402
    async_openai_client,
    http_client,
    openai_client,
    scrape,
    wait_idle,
)

MODEL = "tiny-llama"
MAX_NUM_SEQS = 8
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS),
         "--kv-capacity", str(MAX_NUM_SEQS * 256))
CLIENTS = 64
LOAD_TIMEOUT = 30.0
"""Seconds the whole load may take (a few normally)."""

FAMILIES = [
    "The paged KV cache serves many requests at once; ",
    "Continuous batching admits a waiting request when a row frees; ",
    "A prefix shared by several prompts is computed once and reused: ",
    "Streaming sends each token as soon as it is sampled, ",
]
PROMPTS = [family + suffix for family in FAMILIES for suffix in ("one.", "two, longer.", "three!", "four")]


def plan(seed: int = 20261205):
    """Per client: its prompt, ``max_tokens`` and the chunk after which it hangs up (``None``: it reads
    to the end).  A random quarter hangs up after 1 or 2 chunks."""
    rng = random.Random(seed)
    quitters = set(rng.sample(range(CLIENTS), CLIENTS // 4))
    return [(PROMPTS[i % len(PROMPTS)], 4 + i % 7, rng.choice((1, 2)) if i in quitters else None)
            for i in range(CLIENTS)]


async def one_client(client, prompt: str, max_tokens: int, quit_after: int | None):
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    text, reasons, usage, chunks = [], [], None, 0
    try:
        async for chunk in stream:
            chunks += 1
            for c in chunk.choices:
                text.append(c.text)
                reasons.append(c.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
            if quit_after is not None and chunks >= quit_after:
                return None  # hang up mid-stream
    finally:
        await stream.close()
    return "".join(text), reasons, usage


async def run_load(server, work):
    client = async_openai_client(server)
    try:
        return await asyncio.wait_for(asyncio.gather(*(one_client(client, *w) for w in work)), LOAD_TIMEOUT)
    finally:
        await client.close()


def test_streams_under_load_with_disconnects(server):
    work = plan()
    with http_client(server) as http:
        before = scrape(http)
        results = asyncio.run(run_load(server, work))
        after = wait_idle(http, timeout=20)

        # nothing leaked: no request left, and with the cache released no page in use
        assert http.post("/reset_prefix_cache").status_code == 200
        released = scrape(http)
        assert released.value("ninfer_kv_requests_running") == 0 and released.value("ninfer_kv_requests_waiting") == 0
        assert released.value("ninfer_kv_pages_used", pool="main") == 0, released.text

        survivors = [r for r in results if r is not None]
        assert len(survivors) == CLIENTS - CLIENTS // 4
        grew = lambda name, **labels: after.get(name, **labels) - before.get(name, **labels)  # noqa: E731
        by_reason = {reason: grew("ninfer_kv_requests_total", finish_reason=reason)
                     for reason in ("stop", "length", "abort")}
        assert by_reason["length"] >= len(survivors), by_reason
        assert grew("ninfer_kv_time_to_first_token_seconds_count") >= len(survivors)

    # each complete stream equals the same request served alone, not streamed (cold cache)
    alone: dict[tuple[str, int], str] = {}
    client = openai_client(server)
    try:
        for (prompt, max_tokens, quit_after), result in zip(work, results):
            if quit_after is not None:
                assert result is None
                continue
            text, reasons, usage = result
            if (prompt, max_tokens) not in alone:
                r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
                alone[prompt, max_tokens] = r.choices[0].text
            assert text == alone[prompt, max_tokens], (prompt, max_tokens)
            assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])
            assert usage is not None, "include_usage: the last chunk carries usage"
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), max_tokens)
    finally:
        client.close()

    # every request finished once, with its reason: "length", or "abort" for one whose client hung up first
    assert sum(by_reason.values()) == CLIENTS, f"{CLIENTS} requests sent, ninfer_kv_requests_total grew by {by_reason}"
