"""Text in and out: a ``tokenizer.json`` through the ``tokenizers`` package, the EOS ids, streaming decode.

The tokenizer is optional: a checkpoint directory without ``tokenizer.json`` is served on token ids
(:func:`load_tokenizer` returns ``None``).  With one, the ``tokenizers`` package (the ``hf`` extra:
``pip install "ninfer_kv[hf]"``) must be installed; encoding applies the file's post-processor (the
BOS token Llama adds, for instance), as transformers' tokenizer does.

``tokenizer.json`` is read by this package (a regular file of at most
:data:`~ninfer_kv.models.hf.bounded_files.MAX_TOKENIZER_BYTES`, strict UTF-8, nesting at most
:data:`~ninfer_kv.models.hf.bounded_files.MAX_JSON_DEPTH`) and handed to ``tokenizers`` as text, so
the library never opens a file itself.

The stop tokens, in the Python API (:attr:`~ninfer_kv.models.hf.checkpoint.LoadedModel.eos_token_ids`)
and the command line alike, are ``eos_token_id`` of ``generation_config.json`` when it names one (an
id or a non-empty list), else of ``config.json`` (:func:`eos_token_ids`); every id is checked against
the vocabulary.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Sequence

from .bounded_files import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, check_json_depth, decode_utf8, load_json, read_bounded
from .config import CheckpointError, token_ids

__all__ = ["TextTokenizer", "StreamDecoder", "load_tokenizer", "eos_token_ids", "TOKENIZER_FILE", "GENERATION_CONFIG_FILE"]

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"


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
        raw = read_bounded(path, MAX_TOKENIZER_BYTES)
        text = decode_utf8(raw, path)
        check_json_depth(raw, path)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the library raises its own exception types
            raise CheckpointError(f"{path}: cannot be loaded as a tokenizer ({str(exc)[:200]})") from None
        self.path = Path(path)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the special tokens the file's
        post-processor adds (a BOS) are included — a rendered chat template holds its own, so it is
        encoded without them, as transformers does."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

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
    """The tokenizer of a checkpoint directory, or ``None`` when it has no ``tokenizer.json``
    (one that is not a regular file, a FIFO for instance, is refused)."""
    path = Path(directory) / TOKENIZER_FILE
    return TextTokenizer(path) if os.path.lexists(path) else None


def eos_token_ids(
    directory: str | os.PathLike, config_eos: Sequence[int] = (), vocab_size: int | None = None
) -> tuple[int, ...]:
    """Stop tokens: ``generation_config.json``'s ``eos_token_id`` when it names one, else ``config_eos``.

    Args:
      directory: the checkpoint directory.
      config_eos: ``config.json``'s ids (:attr:`~ninfer_kv.models.hf.config.HFModelInfo.eos_token_ids`).
      vocab_size: when given, every id must be below it.
    Raises:
      CheckpointError: ``generation_config.json`` is not a regular file of at most
        :data:`~ninfer_kv.models.hf.bounded_files.MAX_CONFIG_BYTES` holding a JSON object, or an id is
        not an integer in ``[0, vocab_size - 1]``; the message names the file and the id.
    """
    path = Path(directory) / GENERATION_CONFIG_FILE
    if os.path.lexists(path):
        doc = load_json(path, MAX_CONFIG_BYTES)
        if not isinstance(doc, dict):
            raise CheckpointError(f"{path}: must hold a JSON object, got {type(doc).__name__}")
        ids = token_ids(doc.get("eos_token_id"), f"{path}: eos_token_id", vocab_size)
        if ids:
            return ids
    return token_ids([operator.index(i) for i in config_eos], "config.json: eos_token_id", vocab_size)
