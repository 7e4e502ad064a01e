"""Text in and out: a ``tokenizer.json`` through the ``tokenizers`` package, the EOS ids, streaming decode.

The tokenizer is optional: a checkpoint directory without ``tokenizer.json`` is served on token ids
(:func:`load_tokenizer` returns ``None``).  With one, the ``tokenizers`` package (the ``hf`` extra:
``pip install "ninfer_kv[hf]"``) must be installed; encoding applies the file's post-processor (the
BOS token Llama adds, for instance), as transformers' tokenizer does.

The stop tokens are ``eos_token_id`` of ``generation_config.json`` when it names one (an id or a
list), else of ``config.json`` (:func:`eos_token_ids`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from .config import CheckpointError

__all__ = ["TextTokenizer", "StreamDecoder", "load_tokenizer", "eos_token_ids", "TOKENIZER_FILE"]

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``.

    Args:
      path: the ``tokenizer.json`` file.
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise CheckpointError(
                f"{path} is present but the 'tokenizers' package is not installed; "
                f"install it with pip install \"ninfer_kv[hf]\" (or pass token ids)"
            ) from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises its own exception types
            raise CheckpointError(f"{path}: cannot be loaded as a tokenizer ({exc})") from None
        self.path = Path(path)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens the file's post-processor adds included)."""
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turns a growing list of token ids into text increments.

    Each :meth:`push` decodes the whole sequence and returns what was added since the last call; text
    ending in an incomplete UTF-8 character (decoded as U+FFFD) is held back until it completes.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        """Add ``token``; return the new text (possibly empty)."""
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.emitted):  # a tokenizer that rewrites earlier text: emit the difference
            common = os.path.commonprefix([text, self.emitted])
            self.emitted = common
        new = text[len(self.emitted):]
        self.emitted = text
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end)."""
        text = self.tokenizer.decode(self.ids)
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new


def load_tokenizer(directory: str | os.PathLike) -> TextTokenizer | None:
    """The tokenizer of a checkpoint directory, or ``None`` when it has no ``tokenizer.json``."""
    path = Path(directory) / TOKENIZER_FILE
    return TextTokenizer(path) if path.is_file() else None


def _ids(value, where: str) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in items):
        raise CheckpointError(f"{where}: eos_token_id={value!r} is invalid; it must be a token id or a list of ids")
    return tuple(items)


def eos_token_ids(directory: str | os.PathLike, config_eos: Sequence[int] = ()) -> tuple[int, ...]:
    """Stop tokens: ``generation_config.json``'s ``eos_token_id`` if it has one, else ``config_eos``."""
    path = Path(directory) / "generation_config.json"
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
        if isinstance(doc, dict) and doc.get("eos_token_id") is not None:
            return _ids(doc["eos_token_id"], str(path))
    return tuple(int(i) for i in config_eos)
