"""A checkpoint's chat template, rendered as transformers' ``apply_chat_template`` renders it.

:meth:`ChatTemplate.from_directory` reads the template of a checkpoint directory the way
transformers' tokenizer loading does: ``chat_template.jinja`` when present, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``
entries of which ``"default"`` is used, and ``"tool_use"`` when tools are given), and the special
tokens (``bos_token``, ``eos_token``, ...) of ``tokenizer_config.json``, which the template sees as
variables.  Files are read bounded (:mod:`ninfer_kv.models.hf.bounded_files`): regular files only,
a template of at most :data:`MAX_TEMPLATE_BYTES`, ``tokenizer_config.json`` of at most
:data:`MAX_TOKENIZER_CONFIG_BYTES`, strict UTF-8.

:meth:`ChatTemplate.render` runs the template in jinja2's immutable sandbox with transformers'
settings and helpers (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension,
``raise_exception``, ``strftime_now``, its ``tojson`` filter, ``dict`` and an underscore-proof
``namespace``).  The messages are checked first (:func:`check_messages`) and handed to the template
as plain JSON data.  Every failure of the template, including its own ``raise_exception``, is one
:class:`ChatTemplateError` naming the template.

Rendering needs ``jinja2`` (the ``hf`` extra: ``pip install "ninfer_kv[hf]"``), imported on first use.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ninfer_kv.models.hf.bounded_files import decode_utf8, load_json, read_bounded
from ninfer_kv.models.hf.config import CheckpointError

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "check_messages",
    "CHAT_TEMPLATE_FILE",
    "TOKENIZER_CONFIG_FILE",
    "SPECIAL_TOKEN_NAMES",
    "MAX_TEMPLATE_BYTES",
    "MAX_TOKENIZER_CONFIG_BYTES",
    "MAX_MESSAGES",
    "MAX_DATA_DEPTH",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The template file of a checkpoint directory; it wins over ``tokenizer_config.json``'s ``chat_template``."""

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
"""The file holding the special tokens (and, in older checkpoints, the chat template)."""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens of ``tokenizer_config.json`` a template sees as variables (transformers' named tokens)."""

MAX_TEMPLATE_BYTES = 2**20
"""Largest chat template, in UTF-8 bytes (published ones are up to ~20 KB)."""

MAX_TOKENIZER_CONFIG_BYTES = 32 * 2**20
"""Largest ``tokenizer_config.json`` (published ones are up to a few MB, most of it ``added_tokens_decoder``)."""

MAX_MESSAGES = 4096
"""Most messages in one conversation."""

MAX_DATA_DEPTH = 32
"""Deepest nesting of lists and dicts in a message, a tool or a template variable."""

_MIN_JINJA2 = (3, 1, 6)  # the first release without the known sandbox escapes (transformers requires it too)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, the first the standard


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or rendered; the message names the template."""


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` checked and copied as plain JSON data, as a template sees them.

    A conversation is a list of at most :data:`MAX_MESSAGES` dicts, each with a ``role`` (a str) and
    a ``content``: a str, or a list of ``{"type": "text", "text": str}`` parts (passed to the
    template as given, as transformers does); an assistant message with ``tool_calls`` may have no
    content.  Keys whose value is ``None`` are dropped, and a message's reasoning is also given
    under transformers' other names for it (``reasoning_content``, ``thinking``).  Every value must
    be JSON data (str, int, float, bool, None, lists, dicts with str keys; numpy numbers become
    Python ones) nested at most :data:`MAX_DATA_DEPTH` deep.

    Raises:
      ValueError: naming the bad message by its index, and what is allowed.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages is a {type(messages).__name__}; it must be a list of dicts with 'role' and 'content'")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages has {len(messages)} messages; at most {MAX_MESSAGES} are allowed")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} is a {type(message).__name__}; a message is a dict with 'role' and 'content'")
        message = {k: v for k, v in _plain(message, where, 0).items() if v is not None}
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}['role'] is {role!r}; it must be a non-empty str ('system', 'user', 'assistant', ...)")
        content = message.get("content")
        if content is None:
            if not message.get("tool_calls"):
                raise ValueError(f"{where} has no 'content'; only an assistant message with 'tool_calls' may omit it")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(
                        f"{where}['content'][{j}] is {_short(repr(part))}; a content part must be "
                        "{'type': 'text', 'text': str} (only text is served)"
                    )
        elif not isinstance(content, str):
            raise ValueError(
                f"{where}['content'] is a {type(content).__name__}; it must be a str or a list of "
                "{'type': 'text', 'text': str} parts"
            )
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any, where: str, depth: int) -> Any:
    """``value`` rebuilt from plain JSON types (subclasses stripped to their base type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth >= MAX_DATA_DEPTH:
        raise ValueError(f"{where} is nested deeper than {MAX_DATA_DEPTH} levels; at most {MAX_DATA_DEPTH} are allowed")
    if isinstance(value, np.generic) and value.ndim == 0 and value.dtype.kind in "biuf":
        return _plain(value.item(), where, depth)  # a numpy bool or number
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has the key {_short(repr(k))}; keys must be str")
            out[str.__str__(k)] = _plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{j}]", depth + 1) for j, v in enumerate(value)]
    raise ValueError(f"{where} is a {type(value).__name__}; it must be JSON data (str, int, float, bool, None, list, dict)")


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


class ChatTemplate:
    """A chat template, compiled in jinja2's sandbox, and the special tokens it sees.

    Args:
      source: the template's text, or named templates (``{"default": ..., "tool_use": ...}``,
        ``"default"`` required).
      name: how errors name the template (its file, for instance).
      special_tokens: variables such as ``bos_token`` and ``eos_token`` (str values); keyword
        arguments of :meth:`render` override them.

    Attributes:
      name: as given.
      source: the text of the default template.
      special_tokens: as given, without ``None`` values.
    Raises:
      ChatTemplateError: a template over :data:`MAX_TEMPLATE_BYTES`, not valid jinja2, or no
        ``"default"`` among named templates.
      ImportError: ``jinja2`` is not installed, or is older than 3.1.6.
    """

    def __init__(self, source: str | Mapping[str, str], *, name: str = "chat template", special_tokens: Mapping[str, str] | None = None):
        self.name = name
        sources = {"default": source} if isinstance(source, str) else dict(source)
        if "default" not in sources:
            raise ChatTemplateError(f"{name}: the named templates {sorted(sources)} have no 'default'; one must be named 'default'")
        self.special_tokens = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
        env = _environment()
        self._templates = {}
        for key, text in sources.items():
            label = name if len(sources) == 1 else f"{name} ({key!r})"
            if not isinstance(text, str):
                raise ChatTemplateError(f"{label}: the template is a {type(text).__name__}; it must be a str")
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > MAX_TEMPLATE_BYTES:
                raise ChatTemplateError(f"{label}: the template is {size} bytes; at most {MAX_TEMPLATE_BYTES} are allowed")
            try:
                self._templates[key] = (label, env.from_string(text))
            except Exception as exc:  # noqa: BLE001 - TemplateSyntaxError, or anything the parser raises
                raise ChatTemplateError(f"{label}: not a valid jinja2 template ({_short(str(exc), 300)})") from None
        self.source = sources["default"]

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> ChatTemplate | None:
        """The chat template of a checkpoint directory, or ``None`` when it has none (see the module docstring).

        Raises:
          CheckpointError: a file that is not a regular file, is too large, is not UTF-8 or not
            valid JSON, or a ``chat_template`` or special token of the wrong form; named with its file.
          ChatTemplateError: the template is not valid jinja2.
        """
        directory = Path(directory)
        config_path = directory / TOKENIZER_CONFIG_FILE
        config: dict = {}
        if os.path.lexists(config_path):
            config = load_json(config_path, MAX_TOKENIZER_CONFIG_BYTES)
            if not isinstance(config, dict):
                raise CheckpointError(f"{config_path}: must hold a JSON object, got {type(config).__name__}")
        template_path = directory / CHAT_TEMPLATE_FILE
        if os.path.lexists(template_path):
            source: str | dict[str, str] = decode_utf8(read_bounded(template_path, MAX_TEMPLATE_BYTES), template_path)
            name = str(template_path)
        else:
            source = _config_templates(config.get("chat_template"), config_path)
            if source is None:
                return None
            name = f"{config_path} (chat_template)"
        return cls(source, name=name, special_tokens=_special_tokens(config, config_path))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as the prompt text the model expects.

        Args:
          messages: the conversation (checked by :func:`check_messages`).
          add_generation_prompt: end with the header of the assistant's next turn.
          tools: JSON schemas of the tools the model may call (the ``tool_use`` template is used
            when there is one), or ``None``.
          **kwargs: more variables for the template (``documents``, ``enable_thinking``, ...);
            they override the special tokens of the same name.
        Raises:
          ValueError: a bad message (named by its index), tool or variable.
          ChatTemplateError: the template failed or raised an exception; the message names the template.
        """
        chat = check_messages(messages)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools must be None or a list of dicts (JSON schemas of functions)")
            tools = _plain(tools, "tools", 0)
        variables = {k: _plain(v, k, 0) for k, v in kwargs.items()}
        variables.setdefault("documents", None)
        key = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        label, template = self._templates[key]
        try:
            return template.render(
                {**self.special_tokens, **variables},
                messages=chat,
                tools=tools,
                add_generation_prompt=bool(add_generation_prompt),
            )
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"{label}: the template refused the conversation: {_short(exc.message or '', 500)}") from None
        except Exception as exc:  # noqa: BLE001 - a template is untrusted code; any failure is the template's
            raise ChatTemplateError(f"{label}: rendering failed ({type(exc).__name__}: {_short(str(exc), 500)})") from None


def _config_templates(value: Any, path: Path) -> str | dict[str, str] | None:
    """``tokenizer_config.json``'s ``chat_template``: ``None``, a str, or a list of named templates."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)):
                raise CheckpointError(f"{path}: chat_template[{i}] must be {{\"name\": str, \"template\": str}}")
            named[entry["name"]] = entry["template"]
        return named or None
    raise CheckpointError(f"{path}: chat_template is a {type(value).__name__}; it must be a str or a list of named templates")


def _special_tokens(config: dict, path: Path) -> dict[str, str]:
    """The named special tokens of ``tokenizer_config.json`` (a str, or an AddedToken dict with ``content``)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
            if not isinstance(value, str):
                raise CheckpointError(f"{path}: {name} is an object without a str 'content'; it must be a str or an AddedToken")
        if value is None:
            continue
        if not isinstance(value, str):
            raise CheckpointError(f"{path}: {name} is a {type(value).__name__}; it must be a str or an AddedToken")
        out[name] = value
    return out


class _TemplateRaised(Exception):
    """``raise_exception`` called by a template (turned into :class:`ChatTemplateError`)."""

    def __init__(self, message: Any):
        super().__init__(message)
        self.message = str(message)


@functools.lru_cache(maxsize=1)
def _environment():
    """jinja2's immutable sandbox with transformers' settings, filters and globals (built once)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError('chat templates need the \'jinja2\' package; install it with pip install "ninfer_kv[hf]"') from None
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < _MIN_JINJA2:
        raise ImportError(
            f"chat templates need jinja2 >= {'.'.join(map(str, _MIN_JINJA2))} (older releases have sandbox escapes), "
            f"found {jinja2.__version__}; upgrade it with pip install -U jinja2"
        )

    def raise_exception(message):
        raise _TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` in a template, without the type's attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                TemplateNamespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            TemplateNamespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' (got {key!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
