"""Refused requests: every error is an OpenAI error body with the right status, type and ``param``,
malformed input of any kind is a 4xx (never a crash or a 5xx), and the server serves normally after.

A server is only as robust as its request parsing: a JSON nested 100,000 deep (Python's parser
raises ``RecursionError``), an integer of 5,000 digits (``ValueError`` past CPython's conversion
limit), ``NaN``, invalid UTF-8, the wrong content type, a body over ``--max-request-bytes`` (with
and without ``Content-Length``) each reach code paths a well-formed client never does.  After every
refusal nothing may be left queued or running, and a normal request must still be served.
"""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai  # noqa: E402

from .server_fixtures import assert_error, scrape, wait_idle  # noqa: E402

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 256 * 1024
FLAGS = ("--served-model-name", MODEL, "--max-model-len", MAX_MODEL_LEN, "--max-num-seqs", 4,
         "--kv-capacity", 4 * MAX_MODEL_LEN, "--max-request-bytes", MAX_REQUEST_BYTES)
BAD = "invalid_request_error"

COMPLETION = {"model": MODEL, "prompt": "A normal request", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "A normal chat"}], "max_tokens": 3, "temperature": 0}


def still_serves(server, http) -> None:
    """The process runs, nothing is left running or waiting, and a normal request is served."""
    server.check_alive("after a refused request")
    wait_idle(http, timeout=10)
    r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# field, bad value, the param the error must name: (completion fields, then chat fields)
COMPLETION_CASES = [
    ("prompt", "x" * (MAX_MODEL_LEN + 40), "prompt"),  # longer than the context
    ("prompt", list(range(MAX_MODEL_LEN + 1)), "prompt"),
    ("prompt", 3.5, "prompt"),
    ("prompt", [256], "prompt"),  # a token id outside the vocabulary
    ("prompt", [-1], "prompt"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", -1, "max_tokens"),
    ("max_tokens", "ten", "max_tokens"),
    ("max_tokens", 2.5, "max_tokens"),
    ("max_tokens", [1], "max_tokens"),
    ("temperature", -1, "temperature"),
    ("temperature", "hot", "temperature"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"),
    ("n", 0, "n"),
    ("n", "two", "n"),
    ("stop", [f"s{i}" for i in range(17)], "stop"),  # at most 16
    ("stop", [1, 2], "stop"),
    ("stop", {"a": 1}, "stop"),
    ("logprobs", 21, "logprobs"),
    ("logprobs", -1, "logprobs"),
    ("seed", "abc", "seed"),
]
CHAT_CASES = [
    ("messages", "hello", "messages"),
    ("messages", [{"role": "user", "content": "x" * (MAX_MODEL_LEN + 40)}], "messages"),  # longer than the context
    ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", 0, "max_completion_tokens"),
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("n", 0, "n"),
    ("stop", [f"s{i}" for i in range(17)], "stop"),
    ("top_logprobs", 21, "top_logprobs"),
]


def case_id(case) -> str:
    return f"{case[0]}={str(case[1])[:12]}"


@pytest.mark.parametrize("field,value,param", COMPLETION_CASES, ids=[case_id(c) for c in COMPLETION_CASES])
def test_a_bad_completion_field_is_a_400_naming_it(http, field, value, param):
    assert_error(http.post("/v1/completions", json=dict(COMPLETION, **{field: value})), 400, type=BAD, param=param)
    # a streamed request is refused the same way, before any event
    assert_error(http.post("/v1/completions", json=dict(COMPLETION, stream=True, **{field: value})), 400, type=BAD,
                 param=param)


@pytest.mark.parametrize("field,value,param", CHAT_CASES, ids=[case_id(c) for c in CHAT_CASES])
def test_a_bad_chat_field_is_a_400_naming_it(http, field, value, param):
    body = dict(CHAT, **{field: value})
    if field == "max_completion_tokens":  # alone, as newer clients send it
        del body["max_tokens"]
    assert_error(http.post("/v1/chat/completions", json=body), 400, type=BAD, param=param)


def test_missing_required_fields(http):
    body = dict(COMPLETION)
    del body["prompt"]
    assert_error(http.post("/v1/completions", json=body), 400, type=BAD, param="prompt")
    body = dict(CHAT)
    del body["messages"]
    assert_error(http.post("/v1/chat/completions", json=body), 400, type=BAD, param="messages")


def test_an_unknown_model_is_a_404(http, client):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        assert_error(http.post(path, json=dict(body, model="no-such-model")), 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=1)


def test_the_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert e.value.body is not None and e.value.body.get("type") == BAD


def test_malformed_json_is_a_400(server, http):
    for body in (b'{"model": "tiny-llama", "prompt": ', b"{'model': 1}", b"", b"null", b"[]", b'"text"', b"{}}"):
        r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert_error(r, 400, type=BAD)
    still_serves(server, http)


def test_pathological_json_is_refused_and_the_server_keeps_serving(server, http):
    def post(raw: bytes, content_type: str = "application/json"):
        return http.post("/v1/completions", content=raw, headers={"Content-Type": content_type})

    deep = 100_000
    cases = {
        "100,000 '['": b"[" * deep,
        "balanced nesting 50,000 deep": b"[" * 50_000 + b"]" * 50_000,
        "nested prompt": b'{"model": "tiny-llama", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        "nested object": b'{"a":' * 30_000 + b"1" + b"}" * 30_000,
        "a 5,000-digit integer": b'{"model": "tiny-llama", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        "1e999": b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 1e999}',
        "temperature 1e999": b'{"model": "tiny-llama", "prompt": "x", "temperature": 1e999}',
        "NaN": b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}',
        "Infinity": b'{"model": "tiny-llama", "prompt": "x", "top_p": Infinity}',
        "a token id of 40 digits": b'{"model": "tiny-llama", "prompt": [' + b"1" * 40 + b"]}",
        "invalid UTF-8": b'{"model": "tiny-llama", "prompt": "\xff\xfe\xc3("}',
        "a lone surrogate": b'{"model": "tiny-llama", "prompt": "\\ud800"}',
        "a NUL byte": b'{"model": "tiny-llama", "prompt": "\x00"}',
    }
    for name, raw in cases.items():
        r = post(raw)
        assert 400 <= r.status_code < 500, f"{name}: {r.status_code} {r.text[:300]}"
        assert_error(r, r.status_code)
        server.check_alive(f"after {name}")
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = post(b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 1}', content_type)
        assert 400 <= r.status_code < 500, f"Content-Type {content_type}: {r.status_code} {r.text[:300]}"
        assert_error(r, r.status_code)
    r = http.post("/v1/chat/completions", content=b"[" * deep, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, f"chat, 100,000 '[': {r.status_code} {r.text[:300]}"
    assert_error(r, r.status_code)
    still_serves(server, http)


def test_a_body_over_the_limit_is_a_413(server, http):
    big = dict(COMPLETION, prompt="x" * (MAX_REQUEST_BYTES + 1000))
    assert_error(http.post("/v1/completions", json=big), 413)

    # without a Content-Length (chunked), the limit holds while the body arrives
    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(2 * MAX_REQUEST_BYTES // 65536):
            yield b"y" * 65536
        yield b'"}'

    r = http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(r, 413)
    # just under the limit is read (and refused for its length in tokens, not its size)
    near = dict(COMPLETION, prompt="x" * (MAX_REQUEST_BYTES - 200))
    assert_error(http.post("/v1/completions", json=near), 400, type=BAD, param="prompt")
    still_serves(server, http)


def test_after_every_refusal_nothing_leaked(server, http):
    m = wait_idle(http, timeout=10)
    assert m.value("ninfer_kv_requests_running") == 0 and m.value("ninfer_kv_requests_waiting") == 0
    assert http.post("/reset_prefix_cache").status_code == 200
    assert scrape(http).value("ninfer_kv_pages_used", pool="main") == 0
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
