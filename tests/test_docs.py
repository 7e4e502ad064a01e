"""The documentation runs as written.

Every ```python block of README.md and of each docs/*.md is extracted and run in order, one
script per file, each in its own subprocess (with a timeout) on the CPU; a listing that is not
meant to run is fenced ```text.  Each block of README.md is also run on its own, one subprocess
per block, so a reader can paste any one of them into a fresh interpreter: every README block
carries its own imports and setup.  Each script must stay under 1 GiB of peak resident memory, and
the docs explain the contract themselves rather than citing files the repository does not have.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PEAK_RSS_LIMIT = 1 << 30
TIMEOUT_S = 120

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
_FOOTER = textwrap.dedent(
    """
    import resource as _resource, sys as _sys
    # VmHWM is this process image's own peak; ru_maxrss also keeps the peak of the process that
    # forked it across exec (pytest's, when the suite has grown large).
    try:
        with open("/proc/self/status") as _f:
            _peak = next(int(l.split()[1]) * 1024 for l in _f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        _peak = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss * (1 if _sys.platform == "darwin" else 1024)
    print(f"__peak_rss_bytes__={_peak}")
    """
)


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of every fenced block, in order."""
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 2) for m in _FENCE.finditer(text)]


def doc_script(path: Path) -> str:
    """The ```python blocks of ``path`` joined in order, each preceded by a comment with its line."""
    parts = [f"# {path.name}:{line}\n{code}" for lang, code, line in fenced_blocks(path.read_text()) if lang == "python"]
    return "\n".join(parts)


def python_blocks(path: Path) -> list[tuple[str, int]]:
    """``(code, line)`` of every ```python block of ``path``, in order."""
    return [(code, line) for lang, code, line in fenced_blocks(path.read_text()) if lang == "python"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["JAX_PLATFORMS"] = "cpu"
    if "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    return env


def test_fence_parser():
    text = "a\n```python\nx = 1\n```\n\n```text\nf(a) -> b\n```\n```\nplain\n```\n"
    assert fenced_blocks(text) == [("python", "x = 1\n", 3), ("text", "f(a) -> b\n", 7), ("", "plain\n", 10)]


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_python_blocks_parse(path):
    for lang, code, line in fenced_blocks(path.read_text()):
        if lang == "python":
            try:
                compile(code, f"{path.name}:{line}", "exec")
            except SyntaxError as exc:  # pragma: no cover - the message is the point
                pytest.fail(f"{path.name}:{line}: a ```python block does not parse ({exc}); fence listings as ```text")


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_docs_cite_no_missing_files(path):
    text = path.read_text()
    assert not re.search(r"\bDESIGN\b", text), f"{path.name} cites DESIGN.md, which the repository does not have"
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (path.parent / target).exists(), f"{path.name} links {target}, which does not exist"
    for named in re.findall(r"`([\w.\-]+(?:/[\w.\-]+)+)`", text):  # repository paths named in backticks
        if re.search(r"\.(py|md|ipynb|toml|cc|h)$", named):
            assert (ROOT / named).exists(), f"{path.name} names {named}, which the repository does not have"


def _run_script(script: Path, source: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``source`` as ``script`` in a fresh interpreter; returns the process and its peak RSS in bytes."""
    script.write_text(source + _FOOTER)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=_env(), cwd=script.parent, timeout=TIMEOUT_S
    )
    found = re.search(r"__peak_rss_bytes__=(\d+)", proc.stdout)
    return proc, int(found.group(1)) if found else 0


@pytest.mark.parametrize("path", [p for p in DOCS if doc_script(p)], ids=lambda p: p.name)
def test_python_blocks_run_in_order(path, tmp_path):
    proc, peak = _run_script(tmp_path / f"{path.stem}_doc.py", doc_script(path))
    assert proc.returncode == 0, f"{path.name}: the python blocks fail when run in order:\n{proc.stderr[-4000:]}"
    assert peak < PEAK_RSS_LIMIT, f"{path.name}: the python blocks peak at {peak / 2**30:.2f} GiB resident"


_README_BLOCKS = python_blocks(README)


def test_readme_has_python_blocks():
    assert len(_README_BLOCKS) >= 2


@pytest.mark.parametrize(("code", "line"), _README_BLOCKS, ids=[f"README.md:{line}" for _, line in _README_BLOCKS])
def test_readme_python_block_runs_alone(code, line, tmp_path):
    proc, peak = _run_script(tmp_path / f"readme_{line}.py", f"# README.md:{line}\n{code}")
    assert proc.returncode == 0, (
        f"README.md:{line}: the python block fails when run on its own in a fresh interpreter (every README "
        f"block needs its own imports and setup):\n{proc.stderr[-4000:]}"
    )
    assert peak < PEAK_RSS_LIMIT, f"README.md:{line}: the python block peaks at {peak / 2**30:.2f} GiB resident"


def test_readme_cli_examples_print_what_the_readme_shows(capsys):
    """Every ``ninfer-kv plan`` / ``layout`` line of the README runs; the plan example prints the shown text."""
    import shlex

    from ninfer_kv.cli import main

    blocks = fenced_blocks((ROOT / "README.md").read_text())
    ran = 0
    for i, (lang, code, line) in enumerate(blocks):
        if lang != "bash":
            continue
        for command in code.splitlines():
            argv = shlex.split(command, comments=True)
            if argv[:1] != ["ninfer-kv"] or argv[1:2] not in (["plan"], ["layout"]):
                continue
            assert main(argv[1:]) == 0, f"README.md:{line}: {command}"
            out = capsys.readouterr().out
            ran += 1
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            if argv[1] == "plan" and nxt is not None and nxt[0] == "text":
                assert out == nxt[1], f"README.md:{nxt[2]}: the shown output of `{command}` is stale"
    assert ran >= 3
