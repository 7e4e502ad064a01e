"""Progress reporting: tqdm when installed, a plain stderr line otherwise."""

from __future__ import annotations

import builtins
import io

from ninfer_kv.demo.progress import Progress, make_progress


def test_plain_progress_prints_lines_on_a_pipe():
    stream = io.StringIO()
    bar = Progress(3, stream=stream, interval=0.0)
    bar.update(1, tokens=5)
    bar.update(2, tokens=9)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("demo: 1/3 requests") and "tokens 5" in lines[0]
    assert lines[-1].startswith("demo: 3/3 requests") and "tokens 9" in lines[-1]


def test_plain_progress_throttles_but_always_shows_the_end():
    stream = io.StringIO()
    bar = Progress(100, stream=stream, interval=3600.0)
    for _ in range(100):
        bar.update(1)
    assert len(stream.getvalue().splitlines()) == 2  # the first update and the last


def test_fallback_without_tqdm(monkeypatch):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name == "tqdm" or name.startswith("tqdm."):
            raise ImportError("no tqdm here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    assert isinstance(make_progress(5), Progress)


def test_disabled_progress_is_silent(capsys):
    bar = make_progress(5, enabled=False)
    bar.update(1, tokens=3)
    bar.close()
    assert capsys.readouterr().err == ""
