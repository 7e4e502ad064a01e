"""Two processes x 4 forced CPU devices on localhost run the same sharded step (bounded in time)."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sharded_step.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_digest() -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, str(EXAMPLE), "data=2,model=4"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return _field(out.stdout, "digest")


def _field(out: str, name: str) -> str:
    found = re.search(rf"{name} ([0-9a-f]+)", out)
    assert found, out[-2000:]
    return found.group(1)


def test_two_processes_same_pages_and_result():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), "data=2,model=4", "--process-id", str(i), "--num-processes", "2",
             "--coordinator", f"127.0.0.1:{port}", "--local-devices", "4"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:  # never leave a process behind (a peer that died leaves the other waiting)
            if p.poll() is None:
                p.kill()
                p.wait()
    digests = [_field(o, "digest") for o in outs]
    assert "process 0/2" in outs[0] and "process 1/2" in outs[1]
    tables = [_field(o, "tables") for o in outs]
    assert tables[0] == tables[1]  # the same page IDs on every process from the same inputs
    assert digests[0] == digests[1] == _single_process_digest()
