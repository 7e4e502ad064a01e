"""Without the ``serve`` extra (no FastAPI, uvicorn, sse-starlette, prometheus_client) every other
command works, ``serve --help`` still lists the flags, and ``serve`` itself says what to install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "starlette"):
        sys.modules[name] = None  # an import of it raises ImportError, as when it is not installed
    from ninfer_kv.cli import main
    assert main(["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--max-context", "256",
                 "--max-concurrency", "2", "--kv-cache-dtype", "bf16", "--kv-capacity", "512"]) == 0
    try:
        main(["serve", "--help"])
    except SystemExit as exc:
        assert exc.code == 0, exc.code
    assert main(["serve", "--model", sys.argv[1]]) == 2
    print("ok")
    """
)


def test_other_commands_work_and_serve_names_the_extra_without_the_server_libraries(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "--max-request-bytes" in proc.stdout  # serve --help
    assert 'pip install "ninfer_kv[serve]"' in proc.stderr
