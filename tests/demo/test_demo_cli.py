"""``ninfer-kv demo`` on the command line: bad values exit 2 with one line, ``--json`` prints one
JSON object as the last line of stdout, the text view is the summary table."""

from __future__ import annotations

import json

import pytest

from ninfer_kv.cli import main, registered_subcommands

# the tiny configuration of conftest.py: same jitted steps, so these runs compile nothing new
TINY = ["--model", "tiny", "--max-context", "256", "--max-concurrency", "4", "--kv-capacity", "640",
        "--requests", "4", "--max-new-tokens", "6", "--system-prompts", "1", "--no-progress"]


def test_demo_is_registered():
    assert "demo" in registered_subcommands()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--requests", "0"], "--requests"),
        (["--requests", "many"], "--requests"),
        (["--speculative", "dflash"], "speculative 'dflash' is not supported"),
        (["--profile", "fp16"], "fp16"),
        (["--impl", "cuda"], "impl 'cuda'"),
        (["--model", "huge"], "model 'huge'"),
        (["--draft-window", "2"], "--draft-window applies only to --speculative mtp"),
        (["--kv-lease-window", "8"], "--kv-lease-window applies only with --kv-lease-growth"),
        (["--headroom-bytes", "1MiB"], "--headroom-bytes applies only"),
        (["--kv-capacity", "100"], "--kv-capacity 100"),
        (["--kv-capacity", "640", "--free-bytes", "1GiB"], "not allowed with"),
        (["--host-bytes", "12xyz"], "byte size '12xyz'"),
        (["--max-context", "128"], "--max-context is 128"),
        (["--free-bytes", "1KiB"], "--free-bytes 1024 is too small"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--mesh", "data=x"], "mesh 'data=x' is invalid"),
        (["--mesh", "rows=2"], "write it as data=D,model=T"),
        (["--mesh", "data=3"], "does not split over the data axis of size 3"),
        (["--mesh", "model=3"], "2 KV heads; they do not fit the model axis of size 3"),
        (["--mesh", "data=2", "--speculative", "mtp"], "runs on one device only"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, needle, capsys):
    assert main(["demo", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ninfer-kv demo: error:")
    assert needle in lines[0]


def test_json_is_the_last_line_of_stdout(capsys):
    assert main(["demo", *TINY, "--json"]) == 0
    out, _ = capsys.readouterr()
    data = json.loads(out.strip().splitlines()[-1])
    for key in ("requests", "generated_tokens", "tokens_per_s", "dense_match", "prefix_hits", "offloaded_pages",
                "restored_pages", "compiles", "peak_pages", "profile", "impl", "leaked_pages", "finish_reasons"):
        assert key in data, key
    assert data["requests"] == 4
    assert data["dense_match"] is True
    assert data["dense"]["tolerance"] == 1e-3
    assert data["leaked_pages"] == 0
    assert data["profile"] == "bf16"
    assert data["finish_reasons"] == {"length": 4}
    assert set(data["peak_pages"]) == {"main"}


def test_text_view_is_the_summary_table(capsys):
    assert main(["demo", *TINY, "--no-dense-check"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("ninfer-kv demo: 4 requests on model tiny")
    assert "step functions" in out and "ragged" in out and "decode" in out
    assert "not checked (--no-dense-check)" in out


def test_a_failed_dense_check_prints_the_result_and_exits_3(monkeypatch, capsys):
    """The dense check's verdict is the exit status: FAIL in the table, status 3, the JSON still printed."""
    from ninfer_kv.demo import dense_check, run

    real = dense_check.check_dense

    def strict(*args, **kwargs):  # a zero tolerance: the paged path's last-bit differences fail it
        return real(*args, **dict(kwargs, tolerance=0.0))

    monkeypatch.setattr(run, "check_dense", strict)
    assert main(["demo", *TINY]) == 3
    out = capsys.readouterr().out
    assert "FAIL (exit status 3)" in out
    assert main(["demo", *TINY, "--json"]) == 3
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["dense_match"] is False and data["dense"]["mismatched_requests"]
    monkeypatch.setattr(run, "check_dense", real)
    assert main(["demo", *TINY]) == 0 and "PASS" in capsys.readouterr().out
