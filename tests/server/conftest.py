"""Fixtures of the server tests: the tiny text checkpoint, written once per test process, and the
clients of a module's ``server`` fixture (each module starts its own server with its flags)."""

from __future__ import annotations

import pytest

from .server_fixtures import http_client, openai_client, write_text_checkpoint


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """The checkpoint directory (config, weights, character-level tokenizer, chat template)."""
    return write_text_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


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
