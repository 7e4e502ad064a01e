"""Incremental detokenization and stop strings against real ``tokenizers`` tokenizers trained here.

Two tokenizers are trained on a tiny corpus with non-ASCII text: a byte-level BPE (GPT-2, Llama 3,
Qwen) and a metaspace BPE with byte fallback (Llama 2, Mistral).  The increments of
:class:`IncrementalDetokenizer`, concatenated, must equal ``decode`` of all the ids for any id
sequence, split into pushes any way; :class:`CompletionText` must cut the text at the first stop
string to complete, however the text arrives, and never emit a stop string or what follows it.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from ninfer_kv.engine.detokenize import (  # noqa: E402
    MAX_PENDING_TOKENS,
    PREFIX_TOKENS,
    CompletionText,
    IncrementalDetokenizer,
    StopStringBuffer,
    StopStrings,
)
from ninfer_kv.models.hf.tokenizer import TextTokenizer  # noqa: E402

CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog",
    "日本語のテキスト 🙂🙃 emoji and naïve café résumé",
    "STOP here ### and there ###",
] * 4
SPECIALS = ["<unk>", "<s>", "</s>"]


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _metaspace_byte_fallback():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS + byte_tokens))
    doc = json.loads(tok.to_str())  # the byte tokens are ordinary vocabulary, as in Llama 2's tokenizer.json
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] in SPECIALS]
    return Tokenizer.from_str(json.dumps(doc))


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tok(request, tmp_path_factory) -> TextTokenizer:
    raw = _byte_level() if request.param == "byte_level" else _metaspace_byte_fallback()
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    path.write_text(raw.to_str())
    out = TextTokenizer(path)
    # ids of byte-fallback tokens (none in the byte-level tokenizer, whose every token is bytes)
    out.byte_ids = {int(t[3:5], 16): i for t, i in raw.get_vocab().items() if t.startswith("<0x") and len(t) == 6}
    return out


def output_ids(tok, max_size: int):
    """Token ids a model could emit: any ids for byte-level BPE; for byte fallback, runs of byte
    tokens that are whole UTF-8 characters (ByteFallback turns every byte of a run that is not
    valid UTF-8 into U+FFFD, ASCII included, which no incremental decoder can foresee)."""
    if not tok.byte_ids:
        return st.lists(st.integers(0, tok.vocab_size - 1), max_size=max_size)
    others = [i for i in range(tok.vocab_size) if i not in set(tok.byte_ids.values())]
    piece = st.one_of(
        st.sampled_from(others).map(lambda i: [i]),
        st.characters(codec="utf-8").map(lambda c: [tok.byte_ids[b] for b in c.encode()]),
    )
    return st.lists(piece, max_size=max_size // 2).map(lambda pieces: [i for p in pieces for i in p])


class CountingTokenizer:
    """A tokenizer recording the length of every id list it decodes."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.vocab_size
        self.lengths: list[int] = []

    def decode(self, ids, *, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tok, prompt, ids, cuts, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    parts = [detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    parts.append(detok.flush())
    return parts


def test_the_tokenizers_cover_non_ascii_text(tok):
    text = "héllo wörld 日本語 🙂 ☃"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    parts = _stream(tok, [], ids, range(len(ids)))
    assert "".join(parts) == text


@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_increments_concatenate_to_the_decode_of_all_ids(tok, data, skip):
    ids = data.draw(output_ids(tok, 40), label="ids")
    cuts = data.draw(st.lists(st.integers(0, 40), max_size=8), label="cuts")
    parts = _stream(tok, [], ids, cuts, skip)
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_increments_after_a_prompt_are_the_text_it_adds(tok, data):
    words = st.sampled_from(["héllo", " wörld", " 日本語", " 🙂", " the", " fox", ",", " café", "☃", " ", "\n", "###"])
    prompt = tok.encode("".join(data.draw(st.lists(words, max_size=6), label="prompt")))
    ids = data.draw(output_ids(tok, 30), label="ids")
    whole, before = tok.decode(prompt + ids), tok.decode(prompt)
    parts = _stream(tok, prompt, ids, data.draw(st.lists(st.integers(0, 30), max_size=6), label="cuts"))
    assert whole.startswith(before)  # the prompt ends on a character boundary
    assert "".join(parts) == whole[len(before) :]


def test_the_prompt_gives_the_first_token_its_context(tok):
    prompt = tok.encode("hello")
    out = tok.encode("hello world")[len(prompt) :]
    assert "".join(_stream(tok, prompt, out, range(len(out)))) == " world"


def test_an_incomplete_character_is_held_back_until_it_completes(tok):
    ids = tok.encode("a☃b")  # ☃ is not in the corpus: three byte tokens
    detok = IncrementalDetokenizer(tok, [])
    texts = [detok.push([i]) for i in ids]
    assert "".join(texts) == "a☃b" and "\ufffd" not in "".join(texts)
    assert "☃" in texts  # emitted whole, once its last byte arrived


def test_special_tokens_are_skipped_or_kept(tok):
    eos = 2
    ids = tok.encode("hello")
    assert "".join(_stream(tok, [], ids + [eos], [len(ids)])) == "hello"
    assert "".join(_stream(tok, [], ids + [eos], [len(ids)], skip=False)) == tok.decode(ids + [eos], skip_special_tokens=False)


def test_decode_windows_stay_short(tok):
    """Each push decodes a bounded window, whatever the output: long text, a run of special tokens,
    a run of tokens that end in U+FFFD (invalid bytes), or of ids outside the vocabulary."""
    counting = CountingTokenizer(tok)
    word = tok.encode(" 日本語 héllo 🙂")
    junk = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]  # lone byte tokens >= 0x80
    assert junk
    ids = word * 40 + [2] * 200 + word + junk[:1] * 100 + word + [tok.vocab_size + 5] * 50 + word
    prompt = tok.encode("hi")
    detok = IncrementalDetokenizer(counting, prompt)
    parts = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(parts) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    probes = 2 * len(set(ids))  # the once-per-id special-token probe decodes one id at a time
    assert max(counting.lengths) <= PREFIX_TOKENS + 2 * (MAX_PENDING_TOKENS + 1)
    assert len(counting.lengths) <= probes + 4 * len(ids)


def test_token_ids_are_checked(tok):
    detok = IncrementalDetokenizer(tok, [])
    with pytest.raises(TypeError):
        detok.push([1.5])
    with pytest.raises(ValueError, match="negative"):
        detok.push([-1])


# ---------------------------------------------------------------------------------------------
# Stop strings


def _reference(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text cut at the first stop string to complete (the longest of those ending together)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end - len(s)], s
    return text, None


def _feed(chunks: list[str], stop, emit_every: bool = True):
    out = StopStringBuffer(stop)
    sent = []
    for chunk in chunks:
        reason = out.append(chunk)
        if emit_every:
            piece = out.emit(finished=False)
            sent.append(piece)
            assert out.text.startswith("".join(sent)) and out.output() == "".join(sent)
        if reason is not None:
            break
    sent.append(out.emit(finished=True))
    return out, "".join(sent)


def test_stop_strings_basics():
    s = StopStrings(["###", "\n\n"])
    assert s.max_len == 3 and bool(s) and not StopStrings()
    assert s.find("ab###c", 0) == (2, "###")
    assert s.find("ab###c", 5) is None  # the match ended before the new text
    assert s.find("ab#", 0) is None
    assert StopStrings(["abcd", "bc"]).find("abcd", 0) == (1, "bc")  # "bc" completes first
    assert StopStrings(["c", "abc"]).find("xabc", 0) == (1, "abc")  # the same end: the longest
    assert StopStrings("x").strings == ("x",)
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        StopStrings(["a", ""])


def test_the_buffer_cuts_before_the_stop_string():
    out, sent = _feed(["Hello wor", "ld###and more", " text"], ["###"])
    assert out.text == "Hello world" == sent == out.output() and out.stop_reason == "###" and len(out) == 11
    with pytest.raises(RuntimeError, match="###"):
        out.append("x")
    plain, sent = _feed(["a", "b"], [])
    assert plain.text == "ab" == sent and plain.stop_reason is None and plain.append("") is None


def test_emit_holds_back_what_may_begin_a_stop_string():
    out = StopStringBuffer(["STOP"])
    out.append("abcdST")
    assert out.output() == "abc" and out.output(finished=True) == "abcdST"
    assert out.emit() == "abc"  # "dST" may begin "STOP"
    out.append("O")
    assert out.emit() == "d"  # "STO" may begin "STOP"
    assert out.append("Px") == "STOP"
    assert out.emit() == "" and out.text == "abcd"
    done = StopStringBuffer(["STOP"])
    done.append("abST")
    assert done.emit(finished=True) == "abST" and done.emit(finished=True) == ""


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab#\n日🙂", max_size=40),
    stop=st.lists(st.text(alphabet="ab#\n日🙂", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    emit_every=st.booleans(),
)
def test_stop_strings_are_found_however_the_text_arrives(text, stop, cuts, emit_every):
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, sent = _feed(chunks, stop, emit_every)
    want_text, want_reason = _reference(text, stop)
    assert (out.text, out.stop_reason) == (want_text, want_reason)
    assert sent == want_text  # the stream never carried a stop string or text after it


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_stop_strings_spanning_tokens_are_found(tok, data):
    words = st.sampled_from(["héllo", " wörld", " 日本語", " 🙂", " the", " fox", ",", "☃", " ", "\n", "###", "#"])
    text = "".join(data.draw(st.lists(words, max_size=12), label="text"))
    stop = data.draw(st.lists(st.sampled_from(["###", "日本", "🙂 t", "o w", "\n\n", "☃"]), max_size=2), label="stop")
    ids = tok.encode(text)
    out = CompletionText(tok, [], stop)
    sent = []
    for i in ids:
        if out.push(i) is not None:
            break
        sent.append(out.emit())
    sent.append(out.emit(finished=True))
    want_text, want_reason = _reference(tok.decode(ids), stop)  # metaspace drops a leading space
    assert (out.text, out.stop_reason) == (want_text, want_reason)
    assert "".join(sent) == want_text == out.output(finished=True)


def test_completion_text(tok):
    import numpy as np

    prompt = tok.encode("hello")
    ids = tok.encode("hello wörld ### the fox")[len(prompt) :]
    out = CompletionText(tok, prompt, ["###"])
    assert out.push(np.asarray(ids[:1])) is None  # an array of ids, or one id of any integer type
    assert out.text == tok.decode(prompt + ids[:1])[len("hello") :]
    for i in ids[1:]:
        if out.push(np.int64(i)):
            break
    assert out.stop_reason == "###" and out.text == " wörld " == out.output() == out.emit()
    with pytest.raises(RuntimeError, match="###"):
        out.push(ids[-1])
    assert out.finish() == "###" and out.emit(finished=True) == ""
    cut = CompletionText(tok, [], ())
    for i in tok.encode("a☃")[:-1]:  # the output ends inside a character
        cut.push(i)
    assert cut.text == "a" and cut.output(finished=True) == tok.decode(tok.encode("a☃")[:-1])
