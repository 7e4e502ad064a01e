"""A client that hangs up frees its row at once: with ``--max-num-seqs 1`` the one row is held by a
long stream (450 tokens); the client reads its first chunk and closes the connection, and the next
request must then be served in well under the time the long request takes when it runs to its end
(measured first, on the same server).  The same for a chat stream, for a client that gives up
waiting for a non-streamed answer, and for a client that hangs up while its request still waits in
the queue (it must never take the row).
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .server_fixtures import (  # noqa: E402
    HOST,
    scrape,
    wait_idle,
    wait_until,
)

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
LONG = 450
"""Tokens the long request asks for (it would hold the row for seconds)."""

FLAGS = ("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1",
         "--kv-capacity", str(MAX_MODEL_LEN))
PROMPT_TIMEOUT = 15.0
"""Seconds the next request may take once the row is freed (well under a second normally)."""


@pytest.fixture(scope="module")
def long_seconds(client) -> float:
    """Seconds the long request takes when it runs to its end (the second of two runs: the first
    also compiles the steps of every context length)."""
    for _ in range(2):
        start = time.monotonic()
        r = client.completions.create(model=MODEL, prompt="Hold the only row", max_tokens=LONG, temperature=0,
                                      extra_body={"ignore_eos": True})
        took = time.monotonic() - start
        assert r.usage.completion_tokens == LONG
    return took


def assert_next_request_is_served(client, http, long_seconds: float) -> None:
    """A short request completes in well under the long request's time, and nothing is left running."""
    start = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="The next request", max_tokens=4, temperature=0,
                                  timeout=PROMPT_TIMEOUT)
    took = time.monotonic() - start
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert took < long_seconds / 2, (f"the next request took {took:.2f} s: the hung-up request kept the row "
                                     f"(it takes {long_seconds:.2f} s to run to its end)")
    wait_idle(http, timeout=10)


def test_a_completion_stream_closed_after_its_first_chunk_frees_the_row(client, http, long_seconds):
    wait_idle(http)
    stream = client.completions.create(model=MODEL, prompt="Hold the only row", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices and first.choices[0].finish_reason is None
    stream.close()
    assert_next_request_is_served(client, http, long_seconds)


def test_a_chat_stream_closed_early_frees_the_row(client, http, long_seconds):
    wait_idle(http)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hold the row"}],
                                            max_tokens=LONG, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.close()
    assert_next_request_is_served(client, http, long_seconds)


def raw_request(port: int, body: bytes) -> socket.socket:
    """Send a completion request (raw JSON ``body``) on a bare socket; returns the socket, unread."""
    sock = socket.create_connection((HOST, port), timeout=10)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_the_row(server, client, http, long_seconds):
    wait_idle(http)
    body = (b'{"model": "tiny-llama", "prompt": "Hold the row", "max_tokens": %d, "temperature": 0, '
            b'"ignore_eos": true}' % LONG)
    sock = raw_request(server.port, body)
    wait_until(lambda: scrape(http).value("ninfer_kv_requests_running") == 1, 10, "the request never started")
    sock.close()
    assert_next_request_is_served(client, http, long_seconds)


def test_a_client_that_hangs_up_while_waiting_never_takes_the_row(server, client, http, long_seconds):
    wait_idle(http)
    holder = client.completions.create(model=MODEL, prompt="Hold the row", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(holder)
    next(chunks)
    # a second long request queues behind it, and its client hangs up before any token
    body = (b'{"model": "tiny-llama", "prompt": "Wait in the queue", "max_tokens": %d, "temperature": 0, '
            b'"stream": true, "ignore_eos": true}' % LONG)
    waiter = raw_request(server.port, body)
    wait_until(lambda: scrape(http).value("ninfer_kv_requests_waiting") == 1, 10,
               "the second request never reached the queue")
    waiter.close()
    # it leaves the queue while the row is still held (the holder needs long_seconds to finish)
    wait_until(lambda: scrape(http).value("ninfer_kv_requests_waiting") == 0, long_seconds / 2,
               "the request of a client that hung up stays in the queue")
    holder.close()
    assert_next_request_is_served(client, http, long_seconds)
