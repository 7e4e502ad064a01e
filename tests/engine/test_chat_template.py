"""Chat templates: loading from a checkpoint directory, rendering as transformers does, and every refusal.

Two realistic templates are written here (Llama 3's and Qwen 2.5's, tools included); where
transformers is importable, its ``apply_chat_template`` on the same directory is the oracle.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("jinja2")

from ninfer_kv.engine.chat_template import (  # noqa: E402
    MAX_MESSAGES,
    MAX_TEMPLATE_BYTES,
    ChatTemplate,
    ChatTemplateError,
    check_messages,
)
from ninfer_kv.models.hf.config import CheckpointError  # noqa: E402

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHAT = [
    {"role": "system", "content": "You are terse. Ünïcödé is fine: 日本語 🙂"},
    {"role": "user", "content": "  What is 2+2?  "},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And <b>3+3</b>?"},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city (°C)",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "21"},
]


def _checkpoint(directory, template: str | list | None, *, as_file: bool = False, **tokens) -> str:
    """A directory with a tiny tokenizer.json, tokenizer_config.json and, optionally, chat_template.jinja."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(directory, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    if template is not None and not as_file:
        config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    if as_file:
        with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
            f.write(template)
    return str(directory)


def _transformers(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(directory)


LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"}}


@pytest.mark.parametrize("as_file", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_llama3_matches_transformers(tmp_path, as_file, add_generation_prompt):
    d = _checkpoint(tmp_path / "m", LLAMA3, as_file=as_file, **LLAMA_TOKENS)
    ours = ChatTemplate.from_directory(d).render(CHAT, add_generation_prompt=add_generation_prompt)
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.")
    assert "What is 2+2?<|eot_id|>" in ours  # trimmed
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == add_generation_prompt
    theirs = _transformers(d).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


@pytest.mark.parametrize(
    "messages, tools",
    [(CHAT, None), (CHAT[1:], None), (TOOL_CHAT, TOOLS), ([{"role": "system", "content": "Be brief."}] + TOOL_CHAT, TOOLS)],
)
def test_qwen25_matches_transformers(tmp_path, messages, tools):
    d = _checkpoint(tmp_path / "m", QWEN25, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ours = ChatTemplate.from_directory(d).render(messages, tools=tools)
    assert ours.endswith("<|im_start|>assistant\n")
    if tools:
        assert '"description": "Weather in a city (°C)"' in ours  # tojson keeps non-ASCII, escapes no HTML
        assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in ours
    else:
        assert ours.startswith("<|im_start|>system\n" + (CHAT[0]["content"] if messages[0]["role"] == "system" else "You are Qwen"))
    theirs = _transformers(d).apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_named_templates_pick_tool_use_with_tools(tmp_path):
    named = [{"name": "default", "template": "D{{ messages | length }}"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
    d = _checkpoint(tmp_path / "m", named)
    t = ChatTemplate.from_directory(d)
    assert t.render(CHAT) == "D4" and t.render(CHAT, tools=TOOLS) == "T1"
    tok = _transformers(d)
    assert tok.apply_chat_template(CHAT, tokenize=False) == "D4"
    assert tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False) == "T1"


def test_template_file_wins_over_the_config(tmp_path):
    d = _checkpoint(tmp_path / "m", "FILE", as_file=True, bos_token="<s>")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "CONFIG", "bos_token": "<s>"}, f)
    t = ChatTemplate.from_directory(d)
    assert t.render(CHAT) == "FILE" and t.name.endswith("chat_template.jinja")
    assert t.special_tokens == {"bos_token": "<s>"}


def test_no_template_is_none(tmp_path):
    assert ChatTemplate.from_directory(_checkpoint(tmp_path / "a", None)) is None
    (tmp_path / "b").mkdir()
    assert ChatTemplate.from_directory(tmp_path / "b") is None


def test_helpers_and_variables():
    t = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ messages[0]['content'] | tojson(indent=1) }}"
        "|{{ strftime_now('%Y') | length }}|{{ documents is none }}|{{ enable_thinking }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}",
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    out = t.render([{"role": "user", "content": "é<>"}, {"role": "user", "content": "x"}], enable_thinking=False, eos_token="EOS")
    assert out == '<s>|EOS|False|"é<>"|4|True|False|1'


def test_content_parts_and_reasoning_are_passed_as_transformers_does():
    t = ChatTemplate("{% for m in messages %}{{ m.content[0].text if m.content is not string else m.content }}/{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, {"role": "assistant", "content": "a", "reasoning": "why"}]
    assert t.render(messages) == "parts//;a/why/why;"
    assert check_messages(messages)[0] == {"role": "user", "content": [{"type": "text", "text": "parts"}]}
    import numpy as np

    plain = check_messages([{"role": "user", "content": "x", "n": np.int64(3), "ok": np.bool_(False), "t": ("a",), "none": None}])
    assert plain == [{"role": "user", "content": "x", "n": 3, "ok": False, "t": ["a"]}]
    assert type(plain[0]["n"]) is int and type(plain[0]["ok"]) is bool


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hello", "messages is a str"),
        ({"role": "user"}, "messages is a dict"),
        (["hi"], "messages[0] is a str"),
        ([{"content": "x"}], "messages[0]['role']"),
        ([{"role": "user", "content": "x"}, {"role": 3, "content": "x"}], "messages[1]['role']"),
        ([{"role": "user"}], "messages[0] has no 'content'"),
        ([{"role": "user", "content": 5}], "messages[0]['content'] is a int"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0]['content'][0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0]['content'][0]"),
        ([{"role": "user", "content": "x", "extra": object()}], "messages[0]['extra'] is a object"),
        ([{"role": "user", "content": "x", 5: "y"}], "messages[0] has the key 5"),
        ([{"role": "user", "content": "x", "deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}], "nested deeper"),
        ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), f"at most {MAX_MESSAGES}"),
    ],
)
def test_bad_messages_are_named(messages, fragment):
    with pytest.raises(ValueError) as info:
        ChatTemplate("{{ messages }}").render(messages)
    assert fragment in str(info.value)
    assert not isinstance(info.value, ChatTemplateError)


def test_template_failures_name_the_template():
    with pytest.raises(ChatTemplateError, match=r"^llama: not a valid jinja2 template"):
        ChatTemplate("{% for %}", name="llama")
    strict = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}ok",
        name="strict",
    )
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match=r"^strict: the template refused the conversation: Conversation roles must alternate"):
        strict.render([{"role": "assistant", "content": "x"}])
    for source, what in [
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ undefined_function() }}", "UndefinedError"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),  # the sandbox refuses dunder attributes
        ("{{ ''.__class__.__subclasses__() }}", "SecurityError"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "SecurityError"),
        ("{{ messages.append(1) }}", "SecurityError"),  # the immutable sandbox
    ]:
        with pytest.raises(ChatTemplateError, match=r"^t: rendering failed \(" + what):
            ChatTemplate(source, name="t").render([{"role": "user", "content": "x"}])


def test_named_templates_need_a_default():
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        ChatTemplate({"tool_use": "x"})


def test_oversized_and_malformed_files_are_refused(tmp_path):
    big = "x" * (MAX_TEMPLATE_BYTES + 1)
    with pytest.raises(CheckpointError, match=f"the limit for this file is {MAX_TEMPLATE_BYTES} bytes"):
        ChatTemplate.from_directory(_checkpoint(tmp_path / "a", big, as_file=True))
    with pytest.raises(ChatTemplateError, match=f"at most {MAX_TEMPLATE_BYTES}"):
        ChatTemplate.from_directory(_checkpoint(tmp_path / "b", big))
    with pytest.raises(CheckpointError, match="chat_template is a int"):
        ChatTemplate.from_directory(_checkpoint(tmp_path / "c", 5))
    with pytest.raises(CheckpointError, match=r"chat_template\[0\]"):
        ChatTemplate.from_directory(_checkpoint(tmp_path / "d", [{"name": "default"}]))
    with pytest.raises(CheckpointError, match="bos_token is a int"):
        ChatTemplate.from_directory(_checkpoint(tmp_path / "e", "x", bos_token=1))
    with pytest.raises(CheckpointError, match="eos_token is an object without"):
        ChatTemplate.from_directory(_checkpoint(tmp_path / "f", "x", eos_token={"special": True}))
    d = _checkpoint(tmp_path / "g", None)
    with open(os.path.join(d, "chat_template.jinja"), "wb") as f:
        f.write(b"\xff{{ x }}")
    with pytest.raises(CheckpointError, match="not valid UTF-8"):
        ChatTemplate.from_directory(d)
    h = _checkpoint(tmp_path / "h", None)
    os.remove(os.path.join(h, "tokenizer_config.json"))
    os.mkfifo(os.path.join(h, "tokenizer_config.json"))
    with pytest.raises(CheckpointError, match="not a regular file"):
        ChatTemplate.from_directory(h)
