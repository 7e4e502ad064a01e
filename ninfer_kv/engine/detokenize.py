"""The text of one completion as its tokens arrive: incremental decoding, then stop strings.

:class:`IncrementalDetokenizer` turns token ids into text increments at a cost proportional to the
new tokens, never re-decoding the whole output.  It keeps a short window of ids: a few already
decoded ones (the *prefix*, context for decoders whose output depends on the previous token, such
as a leading space) and the new ones; each :meth:`~IncrementalDetokenizer.push` decodes the window
with and without the new ids and returns the difference (the prefix-offset / read-offset technique
of vLLM and text-generation-inference).  Text ending in U+FFFD, an incomplete UTF-8 character split
across byte tokens, is held back until a later token completes it.  With ``skip_special_tokens``,
special tokens are dropped before they reach the window, which is what ``decode`` does with them,
so a run of them costs nothing.

:class:`StopStringBuffer` accumulates that text and ends it at the first stop string
(:class:`StopStrings`) to complete: the stop string and everything after it are cut off, as vLLM
does, and each search looks only at the new text and the ``max_len - 1`` characters before it.
For streaming, :meth:`~StopStringBuffer.emit` returns the text that is safe to send: while the
completion runs, the last ``max_len - 1`` characters are held back, since they may begin a stop
string.

:class:`CompletionText` is the two together, what a running completion holds: token ids in, its
text, stop string and streamable increments out.
"""

from __future__ import annotations

import numbers
import operator
from typing import Iterable, Protocol, Sequence

__all__ = [
    "IncrementalDetokenizer",
    "StopStrings",
    "StopStringBuffer",
    "CompletionText",
    "PREFIX_TOKENS",
    "MAX_PENDING_TOKENS",
]

PREFIX_TOKENS = 5
"""Already decoded tokens kept before the new ones as decoding context (vLLM uses 5 too)."""

MAX_PENDING_TOKENS = 16
"""Held-back tokens (text ending in U+FFFD, or no text) after which the window is realigned; also
the held-back pushes in a row after which a run of invalid bytes is emitted as U+FFFD."""

_REPLACEMENT = "\ufffd"
_TAIL_BYTES = 3  # bytes of an incomplete UTF-8 character, at most
_CUTS = 4  # cut positions a realignment tries


class _Decoder(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text increments of one completion's tokens, each in time proportional to the new tokens.

    Args:
      tokenizer: a :class:`~ninfer_kv.models.hf.tokenizer.TextTokenizer` (anything with its
        ``decode(ids, *, skip_special_tokens)`` and ``vocab_size``).
      prompt_token_ids: the prompt; its last few (non-special) ids are the context the first
        output tokens are decoded after, so a leading space or a merge with the prompt's last
        token comes out as the decode of the whole sequence has it.
      skip_special_tokens: leave special tokens' text out (as ``decode`` does by default).

    The concatenation of every :meth:`push` and the final :meth:`flush` equals the decode of all the
    output ids, for the byte-level and the metaspace decoders of published checkpoints, when the
    prompt ends on a character boundary.  One exception is inherent to byte-fallback decoders
    (Llama 2, Mistral): ``decode`` turns every byte of a run of byte tokens that is not valid UTF-8
    into U+FFFD, ASCII bytes already emitted included, which no incremental decoder can foresee.

    The window starts where an earlier increment ended on a whole character (never inside a
    character spelled by several byte tokens) at least :data:`PREFIX_TOKENS` ids back, when there
    is one.  A push of ``k`` ids decodes at most ``PREFIX_TOKENS + 2 * (MAX_PENDING_TOKENS + 1) + k``
    ids, however long the output: held-back runs (text ending in U+FFFD, tokens without text) are
    cut by :data:`MAX_PENDING_TOKENS`, and the ids ``decode`` drops (special tokens when skipped,
    ids outside the vocabulary, which a model with a padded embedding may produce) never enter it.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self._special: dict[int, bool] = {}
        self._vocab_size = int(tokenizer.vocab_size)
        context: list[int] = []
        for token in reversed(prompt_token_ids):
            if len(context) == 3 * PREFIX_TOKENS:
                break
            token = operator.index(token)
            if not self._dropped(token):
                context.append(token)
        context.reverse()
        self._ids = context  # the window: context ids, then pending ids
        self._prefix_text = ""  # the text of self._ids[: self._read]
        # Window indices where an increment ended on a whole character: where a window may start.
        self._marks = [0]
        if context:
            # Start the context on a character (not inside one spelled by several byte tokens).
            start = next(
                (k for k in range(PREFIX_TOKENS, len(context)) if not self._decode(context[-k:]).startswith(_REPLACEMENT)),
                len(context),
            )
            self._ids = context[-min(start, len(context)) :]
            self._prefix_text = self._decode(self._ids)
        self._read = len(self._ids)  # window ids before this index are decoded and emitted
        if self._read:
            self._marks.append(self._read)  # the prompt's end
        self._held = 0  # pushes in a row whose text was held back

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _dropped(self, token: int) -> bool:
        """Whether ``decode`` drops ``token``: an id outside the vocabulary, or a special token under
        ``skip_special_tokens`` (probed once per id with two one-token decodes, then cached)."""
        if token >= self._vocab_size:
            return True
        if not self.skip_special_tokens:
            return False
        known = self._special.get(token)
        if known is None:
            alone = self.tokenizer.decode([token], skip_special_tokens=True)
            known = alone == "" and self.tokenizer.decode([token], skip_special_tokens=False) != ""
            self._special[token] = known
        return known

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add the completion's next id(s); return the new text (``""`` while it is held back).

        Raises:
          TypeError: an id is not an integer.
          ValueError: an id is negative.
        """
        added = False
        for token in _ids(token_ids):
            token = operator.index(token)
            if token < 0:
                raise ValueError(f"token id {token} is negative; token ids are integers >= 0")
            if not self._dropped(token):
                self._ids.append(token)
                added = True
        if not added:
            return ""
        text = self._decode(self._ids)
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
            return self._advance(len(self._ids), text)
        self._held += 1
        if len(self._ids) - self._read > MAX_PENDING_TOKENS:
            return self._realign(text)
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end); call it when the completion ends."""
        if self._read == len(self._ids):
            return ""
        return self._advance(len(self._ids), self._decode(self._ids))

    def _advance(self, read: int, text: str) -> str:
        """The window's ids before index ``read`` decode to ``text``, which is final: return its new
        part, mark ``read``, and start the window at the latest mark at least :data:`PREFIX_TOKENS`
        ids before it (else the earliest mark)."""
        new = text[len(self._prefix_text) :]
        self._held = 0
        start = next((m for m in reversed(self._marks) if read - m >= PREFIX_TOKENS), self._marks[0])
        self._marks = [m - start for m in self._marks if m >= start] + [read - start]
        del self._ids[:start]
        self._read = read - start
        self._prefix_text = self._decode(self._ids[: self._read])
        return new

    def _realign(self, text: str) -> str:
        """Too many tokens held back: emit the final text of all but the last few, and move the window on.

        First a clean cut is looked for among the last :data:`_CUTS` positions: ids whose text does
        not end in U+FFFD (a whole character) and is a prefix of ``text``.  Failing that, after
        :data:`MAX_PENDING_TOKENS` pushes in a row held back (a run of invalid bytes), a cut at
        least 3 ids before the end whose text is a prefix of ``text``: an incomplete character is
        at most 3 bytes and a token carries at least one, so the bytes before such a cut are final.
        """
        n = len(self._ids)
        for cut in range(n - 1, max(self._read, n - 1 - _CUTS), -1):
            head = self._decode(self._ids[:cut])
            if len(head) >= len(self._prefix_text) and not head.endswith(_REPLACEMENT) and text.startswith(head):
                return self._advance(cut, head)
        if self._held >= MAX_PENDING_TOKENS:
            for cut in range(n - _TAIL_BYTES, max(self._read, n - _TAIL_BYTES - _CUTS), -1):
                head = self._decode(self._ids[:cut])
                if len(head) >= len(self._prefix_text) and text.startswith(head):
                    return self._advance(cut, head)
        return ""


class StopStrings:
    """The stop strings of a request, and the search for the first one to complete in a text.

    Args:
      stop: the strings (each non-empty); ``()`` for none.

    Attributes:
      strings: the stop strings, in the order given.
      max_len: the longest one's length in characters (``0`` when there are none).
    """

    def __init__(self, stop: Sequence[str] = ()):
        if isinstance(stop, str):
            stop = (stop,)
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]={s!r} is invalid; a stop string is a non-empty str")
        self.strings = tuple(stop)
        self.max_len = max((len(s) for s in self.strings), default=0)

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, new_start: int) -> tuple[int, str] | None:
        """The first stop string to complete in ``text`` among those ending after ``new_start``.

        ``text[:new_start]`` was searched before (no stop string ends inside it), so only
        occurrences ending in ``text[new_start:]`` are looked for, starting each search at
        ``new_start - len(s) + 1``.  The first to complete is the one ending first; of those ending
        together, the longest.  Processing text in one piece or character by character finds the same.

        Returns:
          ``(index where it starts, the stop string)``, or ``None``.
        """
        best: tuple[int, int, str] | None = None  # (end, start, string)
        for s in self.strings:
            i = text.find(s, max(0, new_start - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])


class StopStringBuffer:
    """Text that ends at the first stop string, and the part of it safe to stream.

    Args:
      stop: the stop strings (a :class:`StopStrings` or a sequence of str).

    Attributes:
      stops: the :class:`StopStrings`.
      stop_reason: the stop string that ended the text, or ``None``.
    """

    def __init__(self, stop: StopStrings | Sequence[str] = ()):
        self.stops = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._hold = max(self.stops.max_len - 1, 0)
        self._chunks: list[str] = []  # the whole text, in pieces
        self._length = 0
        self._tail = ""  # the last self._hold characters of the text
        self._unsent: list[str] = []  # the text emit() has not returned yet, in pieces
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The text so far (without the stop string that ended it, and anything after)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def __len__(self) -> int:
        return self._length

    def append(self, new_text: str) -> str | None:
        """Add ``new_text``; return the stop string that completed in it (the text is cut before it), or ``None``.

        Linear in ``len(new_text)`` plus the longest stop string.

        Raises:
          RuntimeError: the text already ended at a stop string.
        """
        if self.stop_reason is not None:
            raise RuntimeError(f"the text already ended at the stop string {self.stop_reason!r}; nothing can be appended")
        if not new_text:
            return None
        found = None
        if self.stops:
            window = self._tail + new_text
            found = self.stops.find(window, len(self._tail))
            if found is None:
                self._tail = window[max(0, len(window) - self._hold) :] if self._hold else ""
        self._chunks.append(new_text)
        self._unsent.append(new_text)
        self._length += len(new_text)
        if found is None:
            return None
        start, self.stop_reason = found
        cut = self._length - (len(self._tail) + len(new_text) - start)  # the match's start in the whole text
        _drop_last(self._chunks, self._length - cut)
        _drop_last(self._unsent, self._length - cut)
        self._length = cut
        self._tail = ""
        return self.stop_reason

    def _held(self, finished: bool) -> int:
        """Characters at the end that may begin a stop string (none once the text has ended)."""
        return 0 if finished or self.stop_reason is not None else min(self._hold, self._length)

    def emit(self, finished: bool = False) -> str:
        """The text not returned before that is safe to send now.

        While the text runs (``finished`` false and no stop string found), its last
        ``max_len - 1`` characters are held back: they may be the start of a stop string.  Once it
        has ended, everything left is returned.
        """
        if not self._unsent:
            return ""
        pending = "".join(self._unsent)
        keep = min(self._held(finished), len(pending))
        self._unsent = [pending[len(pending) - keep :]] if keep else []
        return pending[: len(pending) - keep]

    def output(self, finished: bool = False) -> str:
        """The whole text safe to show now: :attr:`text` less what :meth:`emit` would hold back."""
        text = self.text
        return text[: len(text) - self._held(finished)]


class CompletionText:
    """The text of one completion from its token ids: :class:`IncrementalDetokenizer`, then
    :class:`StopStringBuffer`.

    Args:
      tokenizer: as for :class:`IncrementalDetokenizer`.
      prompt_token_ids: the prompt (decoding context).
      stop: the request's stop strings.
      skip_special_tokens: leave special tokens' text out.

    Attributes:
      detokenizer: the :class:`IncrementalDetokenizer`.
      buffer: the :class:`StopStringBuffer`.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int] = (),
        stop: StopStrings | Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.buffer = StopStringBuffer(stop)

    @property
    def text(self) -> str:
        """The text so far (without a stop string that ended it, and anything after)."""
        return self.buffer.text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self.buffer.stop_reason

    def push(self, token_ids: int | Iterable[int]) -> str | None:
        """Add the next generated id(s); return the stop string that ended the text with them, or ``None``.

        Raises:
          RuntimeError: the text already ended at a stop string.
          TypeError, ValueError: an id that is not an integer ``>= 0``.
        """
        if self.buffer.stop_reason is not None:
            raise RuntimeError(f"the text already ended at the stop string {self.buffer.stop_reason!r}; nothing can be pushed")
        return self.buffer.append(self.detokenizer.push(_ids(token_ids)))

    def finish(self) -> str | None:
        """The completion has ended: add the text still held back (an incomplete character at the
        end); return :attr:`stop_reason`.  Idempotent."""
        if self.buffer.stop_reason is None:
            self.buffer.append(self.detokenizer.flush())
        return self.buffer.stop_reason

    def emit(self, finished: bool = False) -> str:
        """The text not returned before that is safe to stream now (:meth:`StopStringBuffer.emit`);
        with ``finished``, everything left (after :meth:`finish`)."""
        if finished:
            self.finish()
        return self.buffer.emit(finished)

    def output(self, finished: bool = False) -> str:
        """The whole text safe to show now (:meth:`StopStringBuffer.output`); with ``finished``, all
        of it (after :meth:`finish`)."""
        if finished:
            self.finish()
        return self.buffer.output(finished)


def _ids(token_ids: int | Iterable[int]) -> Iterable[int]:
    return (token_ids,) if isinstance(token_ids, numbers.Integral) else token_ids


def _drop_last(chunks: list[str], n: int) -> None:
    """Remove the last ``n`` characters of the text held in ``chunks``."""
    while n > 0 and chunks:
        last = chunks[-1]
        if len(last) <= n:
            chunks.pop()
            n -= len(last)
        else:
            chunks[-1] = last[: len(last) - n]
            n = 0
