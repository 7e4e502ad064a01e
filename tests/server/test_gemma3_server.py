"""``ninfer-kv serve`` over a Gemma 3 checkpoint written by transformers (a 48-token sliding window on two of
its three layers, QK-norm, a local and a scaled global RoPE, the final soft cap), through the official
``openai`` client: chat completions, streamed or not, render Gemma's ``<start_of_turn>`` template as
transformers' ``apply_chat_template`` does and answer with transformers' greedy tokens (up to reported near
ties); completions of prompts longer than the window too.  The checkpoint, tokenizer and oracle are
tests/engine/family_checkpoints.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the engine tests' checkpoint helpers
from engine.family_checkpoints import (  # noqa: E402
    CONVERSATIONS,
    MAX_MODEL_LEN,
    TransformersGreedy,
    characters,
    compare_greedy,
    transformers_render,
    write_text_checkpoint,
)

from .server_fixtures import openai_client, running_server  # noqa: E402

FAMILY = "gemma3"
MODEL = "tiny-gemma3"
MAX_TOKENS = 8
FLAGS = ("--served-model-name", MODEL, "--max-model-len", MAX_MODEL_LEN, "--max-num-seqs", 4,
         "--kv-capacity", 4 * MAX_MODEL_LEN, "--seed", 0)
CHARS = characters(FAMILY)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_text_checkpoint(FAMILY, tmp_path_factory.mktemp(FAMILY))


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    with running_server(checkpoint, *[str(f) for f in FLAGS], log_dir=tmp_path_factory.mktemp("serve")) as server:
        c = openai_client(server)
        yield c
        c.close()


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return TransformersGreedy(FAMILY, checkpoint)


def ids_of(text: str) -> list[int]:
    """The token ids of generated text (one character per id; the special tokens are never generated here)."""
    return [CHARS.index(c) for c in text]


def check(what: str, oracle, prompt_ids, text: str) -> None:
    ref, logits = oracle(prompt_ids, MAX_TOKENS)
    ours = ids_of(text)
    assert compare_greedy(what, ours, ref, logits, arbiter=oracle.arbiter(prompt_ids, ref)) >= MAX_TOKENS // 2


def test_chat_completions_answer_as_transformers(client, oracle, checkpoint):
    messages = CONVERSATIONS[FAMILY]
    _, ids = transformers_render(FAMILY, checkpoint, messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == MAX_TOKENS
    check("chat", oracle, ids, choice.message.content)
    # streamed: the same text, delta by delta
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == choice.message.content


def test_completions_of_prompts_longer_than_the_window(client, oracle):
    prompts = [[(7 * i + 3 * k) % 250 for i in range(n)] for k, n in enumerate((60, 130, 190))]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    texts = {c.index: c.text for c in r.choices}
    for k, prompt in enumerate(prompts):
        check(f"completion p{len(prompt)}", oracle, prompt, texts[k])
