"""Fixtures of the server tests: the tiny text checkpoint, written once per test process, and the
server each test module starts with its own ``FLAGS``, and that server's clients."""

from __future__ import annotations

import pytest

from .server_fixtures import http_client, openai_client, running_server, write_text_checkpoint


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """The checkpoint directory (config, weights, character-level tokenizer, chat template)."""
    return write_text_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(request, text_checkpoint, tmp_path_factory):
    """A server process over the checkpoint, started with the test module's ``FLAGS``."""
    flags = [str(f) for f in request.module.FLAGS]
    with running_server(text_checkpoint, *flags, log_dir=tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    """The official ``openai`` client of the module's server."""
    c = openai_client(server)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    """A raw ``httpx`` client of the module's server (what the openai client does not send)."""
    with http_client(server) as c:
        yield c
