"""``--api-key``: every route but ``/health`` wants ``Authorization: Bearer KEY``; a missing, wrong
or malformed credential is a 401 OpenAI error, the right key is served.  Also the command line:
``serve --help`` names every flag of the contract, without ``--served-model-name`` the model is
served under the ``--model`` argument as given, and the engine flags these tests need no particular
values of are accepted (an int8 KV cache, float32 weights, a host tier, a seed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import openai  # noqa: E402

from .server_fixtures import assert_error, http_client, openai_client, running_server  # noqa: E402

KEY = "sk-test-7f3a9c"
FLAGS = ("--api-key", KEY, "--max-model-len", "256", "--max-num-seqs", "2", "--kv-capacity", "512",
         "--kv-cache-dtype", "int8", "--dtype", "float32", "--host-memory", str(16 * 2**20), "--seed", "5")

ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("GET", "/metrics", None),
    ("POST", "/reset_prefix_cache", None),
]


@pytest.fixture(scope="module")
def model_name(text_checkpoint) -> str:
    """The served name: the ``--model`` argument exactly as passed."""
    return str(text_checkpoint)


def request(client, method, path, body, model_name):
    if body is None:
        return client.request(method, path)
    return client.request(method, path, json=dict(body, model=model_name))


def test_health_needs_no_key(server):
    with http_client(server) as http:
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_other_route_wants_the_key(server, model_name, method, path, body):
    with http_client(server) as anonymous:
        assert_error(request(anonymous, method, path, body, model_name), 401)
    with http_client(server, api_key="sk-wrong") as wrong:
        assert_error(request(wrong, method, path, body, model_name), 401)
    with http_client(server, api_key=KEY + "x") as longer:
        assert_error(request(longer, method, path, body, model_name), 401)
    with http_client(server) as unprefixed:  # the key without the Bearer scheme
        r = unprefixed.request(method, path, headers={"Authorization": KEY},
                               **({} if body is None else {"json": dict(body, model=model_name)}))
        assert_error(r, 401)
    with http_client(server, api_key=KEY) as right:
        r = request(right, method, path, body, model_name)
        assert r.status_code == 200, r.text


def test_the_openai_client_with_and_without_the_key(server, model_name):
    wrong = openai_client(server, api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=model_name, prompt="x", max_tokens=1)
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    wrong.close()

    client = openai_client(server, api_key=KEY)
    assert [m.id for m in client.models.list().data] == [model_name]
    r = client.completions.create(model=model_name, prompt="Authorized", max_tokens=2, temperature=0)
    assert r.model == model_name and r.usage.completion_tokens == 2
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 2
    client.close()


def test_serve_help_names_every_flag():
    out = subprocess.run([sys.executable, "-m", "ninfer_kv", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--host", "--port", "--served-model-name", "--api-key", "--max-model-len",
                 "--max-num-seqs", "--kv-cache-dtype", "--kv-capacity", "--host-memory", "--dtype", "--seed",
                 "--max-request-bytes", "--shutdown-grace"):
        assert flag in out.stdout, f"serve --help does not name {flag}:\n{out.stdout}"
