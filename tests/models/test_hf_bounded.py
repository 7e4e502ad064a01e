"""Bounded reading of checkpoint files: FIFOs refused without blocking, size caps, strict UTF-8, JSON
nesting measured before parsing; every refusal one CheckpointError naming the file, nothing left open."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fixtures import FAMILY_CONFIGS, random_tensors, write_checkpoint
from ninfer_kv.models.hf import CheckpointError, eos_token_ids, load_checkpoint, load_tokenizer, read_header
from ninfer_kv.models.hf.bounded_files import (
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    MAX_JSON_DEPTH,
    MAX_TOKENIZER_BYTES,
    RegularFile,
    check_json_depth,
    parse_json,
    read_bounded,
)

DEEP = 100_000


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _refusal(fn, timeout: float = 20.0) -> BaseException | None:
    """Run ``fn`` in a thread; fail (instead of hanging) when it has not returned within ``timeout`` s."""
    box: dict = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the loader blocked"
    return box.get("exc")


def _unblock(fifo) -> None:
    """Open ``fifo`` for writing and close it, so a reader blocked on it (a regression) gets EOF."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader: nothing blocked


@pytest.fixture
def sharded(tmp_path):
    cfg = dict(FAMILY_CONFIGS["mistral"], eos_token_id=2)
    return write_checkpoint(tmp_path / "ck", cfg, random_tensors(cfg, seed=2, dtype="BF16"), shards=2)


@pytest.fixture
def single(tmp_path):
    cfg = dict(FAMILY_CONFIGS["qwen2"], eos_token_id=2)
    return write_checkpoint(tmp_path / "one", cfg, random_tensors(cfg, seed=1, dtype="BF16"))


def _tokenizer_json(path) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer needs the 'hf' extra")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.save(str(path))


# -- FIFOs and other non-regular files ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "generation_config.json",
                                  "model-00001-of-00002.safetensors"])
def test_a_fifo_is_refused_promptly(sharded, name):
    path = sharded / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    try:
        exc = _refusal(lambda: load_checkpoint(sharded))
    finally:
        _unblock(path)
    assert isinstance(exc, CheckpointError), exc
    assert f"{name}: is not a regular file (a FIFO)" in str(exc)


def test_a_fifo_tokenizer_and_single_file_are_refused_promptly(single):
    os.mkfifo(single / "tokenizer.json")
    (single / "model.safetensors").unlink()
    os.mkfifo(single / "model.safetensors")
    try:
        for fn, name in ((lambda: load_tokenizer(single), "tokenizer.json"),
                         (lambda: load_checkpoint(single), "model.safetensors")):
            exc = _refusal(fn)
            assert isinstance(exc, CheckpointError) and f"{name}: is not a regular file (a FIFO)" in str(exc), exc
    finally:
        _unblock(single / "tokenizer.json")
        _unblock(single / "model.safetensors")


def test_a_directory_is_not_a_file(single):
    (single / "config.json").unlink()
    (single / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: is not a regular file \(a directory\)"):
        load_checkpoint(single)


# -- size caps ----------------------------------------------------------------------------------------


def _sparse(path, size: int) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("name, limit", [("config.json", MAX_CONFIG_BYTES), ("generation_config.json", MAX_CONFIG_BYTES),
                                         ("model.safetensors.index.json", MAX_INDEX_BYTES)])
def test_json_files_over_their_cap_are_refused_before_reading(sharded, name, limit):
    _sparse(sharded / name, limit + 1)
    with pytest.raises(CheckpointError, match=rf"{name}: {limit + 1} bytes is too large; the limit for this file is {limit}"):
        load_checkpoint(sharded)


def test_tokenizer_over_its_cap_is_refused(single):
    pytest.importorskip("tokenizers")
    _sparse(single / "tokenizer.json", MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(CheckpointError, match=rf"tokenizer\.json: {MAX_TOKENIZER_BYTES + 1} bytes is too large"):
        load_tokenizer(single)


def test_read_bounded_reads_at_most_the_cap(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read_bounded(tmp_path / "f", 10) == b"x" * 10
    with pytest.raises(CheckpointError, match=r"10 bytes is too large; the limit for this file is 9 bytes"):
        read_bounded(tmp_path / "f", 9)
    with pytest.raises(CheckpointError, match=r"missing: cannot be opened \(No such file or directory\)"):
        read_bounded(tmp_path / "missing", 9)


# -- UTF-8 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "generation_config.json"])
def test_non_utf8_json_names_the_file_and_the_byte(sharded, name):
    (sharded / name).write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(CheckpointError, match=rf"{name}: not valid UTF-8 at byte 10 \(invalid continuation byte\)"):
        load_checkpoint(sharded)
    (sharded / name).write_bytes(b"\xef\xbb\xbf{}")
    with pytest.raises(CheckpointError, match=rf"{name}: starts with a UTF-8 byte-order mark"):
        load_checkpoint(sharded)


def test_non_utf8_header_and_tokenizer_name_the_file(single, tmp_path):
    raw = b'{"a\xff": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}'
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"x\.safetensors \(header\): not valid UTF-8 at byte 3"):
        read_header(tmp_path / "x.safetensors")
    pytest.importorskip("tokenizers")
    (single / "tokenizer.json").write_bytes(b'{"\xc3(": 1}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not valid UTF-8 at byte 2"):
        load_tokenizer(single)


# -- nesting depth -------------------------------------------------------------------------------------


def _deep(n: int = DEEP) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "generation_config.json"])
def test_deep_nesting_is_refused_before_parsing(sharded, name):
    (sharded / name).write_text('{"weight_map": ' + _deep() + "}")
    with pytest.raises(CheckpointError, match=rf"{name}: JSON nested deeper than {MAX_JSON_DEPTH} levels \(at byte 78\)"):
        load_checkpoint(sharded)


def test_deep_nesting_in_a_header_and_a_tokenizer(single, tmp_path):
    raw = ('{"a": ' + _deep() + "}").encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match=r"x\.safetensors \(header\): JSON nested deeper than 64 levels"):
        read_header(tmp_path / "x.safetensors")
    pytest.importorskip("tokenizers")
    (single / "tokenizer.json").write_text('{"model": ' + _deep() + "}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: JSON nested deeper than 64 levels"):
        load_tokenizer(single)


def test_depth_ignores_brackets_inside_strings():
    ok = json.dumps({"a": "[[[[{{{{" * 100, "b": '\\"[[[[', "c": ["\\", "]]]]"] * 3, "d": "x\\\\"})
    check_json_depth(ok.encode(), "t", limit=2)
    assert parse_json(ok.encode(), "t")["c"][1] == "]]]]"
    check_json_depth(_deep(64).encode(), "t")
    with pytest.raises(CheckpointError, match=r"t: JSON nested deeper than 64 levels \(at byte 64\)"):
        check_json_depth(_deep(65).encode(), "t")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(alphabet='ab"\\[]{}', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\[{', max_size=3), inner, max_size=3),
    max_leaves=20,
)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


@settings(max_examples=100, deadline=None)
@given(_json, st.integers(0, 6))
def test_depth_is_exact_on_valid_json(value, limit):
    raw = json.dumps(value).encode()
    if _depth(value) > limit:
        with pytest.raises(CheckpointError, match="nested deeper"):
            check_json_depth(raw, "t", limit)
    else:
        check_json_depth(raw, "t", limit)


def test_depth_scan_crosses_its_chunks(monkeypatch):
    from ninfer_kv.models.hf import bounded_files

    monkeypatch.setattr(bounded_files, "_CHUNK", 7)
    text = json.dumps({"x": "]]" * 9, "y": [[["a\\\"]]]"]]], "z": [[[[1]]]]}).encode()
    check_json_depth(text, "t", limit=5)
    with pytest.raises(CheckpointError, match="nested deeper than 4"):
        check_json_depth(text, "t", limit=4)


# -- descriptors ---------------------------------------------------------------------------------------


def test_refusals_leave_nothing_open(sharded, tmp_path):
    good = (sharded / "config.json").read_text()
    cases = [("config.json", b"\xff"), ("config.json", _deep().encode()), ("config.json", b"[]"),
             ("model.safetensors.index.json", b"{}"), ("generation_config.json", b'{"eos_token_id": 999}'),
             ("model-00001-of-00002.safetensors", b"short")]
    load_checkpoint(sharded)  # warm up whatever the backend opens once
    before = _open_fds()
    for name, data in cases:
        path = sharded / name
        original = path.read_bytes() if path.exists() else None
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            load_checkpoint(sharded)
        path.write_bytes(original) if original is not None else path.unlink()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CheckpointError, match="FIFO"):
        RegularFile(tmp_path / "fifo")
    assert _open_fds() == before
    assert (sharded / "config.json").read_text() == good
    maps = open("/proc/self/maps").read()
    assert str(sharded) not in maps  # nothing of the checkpoint is mapped


def test_generation_config_eos_is_checked_and_named(single):
    (single / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 256]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id=\[2, 256\] holds id 256 outside "
                                              r"the vocabulary; ids must be in \[0, 255\] \(vocab_size=256\)"):
        load_checkpoint(single)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        eos_token_ids(single, (2,), vocab_size=256)
    assert eos_token_ids(single, (2,)) == (2, 256)  # no vocabulary given: not checked
    (single / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id='2' is invalid"):
        eos_token_ids(single, (2,))
    (single / "generation_config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: must hold a JSON object"):
        eos_token_ids(single, (2,))
