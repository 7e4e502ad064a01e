"""Fixtures of the server tests: the tiny text checkpoint, written once per test process."""

from __future__ import annotations

import pytest

from .server_fixtures import write_text_checkpoint


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """The checkpoint directory (config, weights, character-level tokenizer, chat template)."""
    return write_text_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
