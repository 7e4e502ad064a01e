"""Text checkpoints of the sliding-window and Gemma families for the engine and server tests.

Each is the tiny bfloat16 checkpoint transformers writes for the family
(:func:`hf_fixtures.save_transformers_checkpoint`: windows of 48 or 80 tokens), a character-level tokenizer
covering the whole vocabulary (one character per id, the family's special tokens last, so chat markers
are single tokens) and ``tokenizer_config.json`` with the family's chat template (Gemma's
``<start_of_turn>`` turns, Mistral's ``[INST]``, Qwen2's ChatML) and special tokens.

The oracle is transformers itself: :func:`transformers_render` renders templates with transformers' own
``apply_chat_template``, :class:`TransformersGreedy` runs the model's eager attention, and
:func:`hf_fixtures.compare_greedy` (re-exported here) compares tokens up to near ties.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

_MODEL_TESTS = str(Path(__file__).resolve().parents[1] / "models")
if _MODEL_TESTS not in sys.path:  # hf_fixtures lives beside the model tests (a rootdir module there)
    sys.path.insert(0, _MODEL_TESTS)

from hf_fixtures import (  # noqa: E402
    WINDOW_COMMON,
    compare_greedy,
    float32_arbiter,
    load_transformers_model,
    save_transformers_checkpoint,
)

__all__ = ["CONVERSATIONS", "FAMILY_TEXT", "MAX_MODEL_LEN", "TransformersGreedy", "characters", "compare_greedy",
           "transformers_render", "transformers_tokenizer", "write_text_checkpoint"]

VOCAB = WINDOW_COMMON["vocab_size"]
MAX_MODEL_LEN = 256

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

FAMILY_TEXT = {
    # family: (chat template, special tokens, {name: token} of tokenizer_config.json)
    "gemma2": (GEMMA2_TEMPLATE, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
               {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "gemma3": (GEMMA3_TEMPLATE, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
               {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "mistral": (MISTRAL_TEMPLATE, ["<s>", "</s>"], {"bos_token": "<s>", "eos_token": "</s>"}),
    "qwen2": (CHATML_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"}),
}

LONG = ("A paged cache keeps every layer's keys and values in pages of sixty-four tokens; a sliding layer reads "
        "only the last few of them.")
CONVERSATIONS = {
    # the first user turn alone is longer than every window
    "gemma2": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Only the window."},
               {"role": "user", "content": "And the global layers?  "}],
    "gemma3": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": LONG},
               {"role": "assistant", "content": "Only the window."},
               {"role": "user", "content": [{"type": "text", "text": "And the global layers?"}]}],
    "mistral": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Only the window."},
                {"role": "user", "content": "And the other layers?"}],
    "qwen2": [{"role": "user", "content": LONG}],
}


def characters(family: str) -> list[str]:
    """Token id -> its text: printable ASCII, newline, Latin Extended letters, the special tokens last."""
    specials = FAMILY_TEXT[family][1]
    n = VOCAB - len(specials) - 96
    return [chr(c) for c in range(32, 127)] + ["\n"] + [chr(0x100 + i) for i in range(n)] + specials


def write_text_checkpoint(family: str, directory: Path) -> Path:
    """The family's transformers checkpoint with its tokenizer and chat template, in ``directory``."""
    tokenizers = pytest.importorskip("tokenizers", reason="text prompts need the 'hf' extra")
    save_transformers_checkpoint(family, directory)
    template, specials, named = FAMILY_TEXT[family]
    plain = characters(family)[: VOCAB - len(specials)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(plain)}, merges=[]))
    tok.decoder = tokenizers.decoders.Fuse()
    assert tok.add_special_tokens(specials) == len(specials)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **named}))
    return directory


def transformers_tokenizer(family: str, directory: Path):
    """transformers' tokenizer over the same ``tokenizer.json`` and special tokens (its own template renderer)."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **FAMILY_TEXT[family][2])


def transformers_render(family: str, directory: Path, messages) -> tuple[str, list[int]]:
    """``messages`` rendered by transformers' ``apply_chat_template`` with the family's template, and its ids."""
    tok = transformers_tokenizer(family, directory)
    text = tok.apply_chat_template(messages, chat_template=FAMILY_TEXT[family][0], tokenize=False,
                                   add_generation_prompt=True)
    return text, tok(text, add_special_tokens=False)["input_ids"]


class TransformersGreedy:
    """transformers' greedy tokens and their logits (bfloat16, eager attention), each prompt computed once;
    :meth:`arbiter` judges a difference with the same weights in float32."""

    def __init__(self, family: str, directory: Path):
        self.family, self.directory = family, directory
        self.model = load_transformers_model(family, directory)
        self._exact = None
        self.results: dict[tuple, tuple[list[int], np.ndarray]] = {}

    def arbiter(self, prompt, ref):
        """:func:`hf_fixtures.float32_arbiter` of the float32 model (loaded on first use)."""
        if self._exact is None:
            self._exact = load_transformers_model(self.family, self.directory, "float32")
        return float32_arbiter(self._exact, prompt, ref)

    def __call__(self, prompt, max_tokens: int) -> tuple[list[int], np.ndarray]:
        import torch

        key = (tuple(int(t) for t in prompt), max_tokens)
        if key not in self.results:
            ids = torch.tensor([list(key[0])])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                                          pad_token_id=0)
            self.results[key] = (out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits, 1)[0].float().numpy())
        return self.results[key]
