"""Sharded KV on 8 forced host devices, each family in its own subprocess (see worker.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(check: str, timeout: int = 240) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), check], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_ops_bit_equal_to_one_device():
    """2x4: every profile, both orders (FFI, bit-equal codes and outputs); 8x1, 1x8, replicated heads
    and the reference on fewer profiles."""
    assert "checks passed" in _run("ops_fast")


@pytest.mark.slow
def test_ops_bit_equal_every_profile_every_mesh():
    assert "checks passed" in _run("ops_all", timeout=900)


def test_compiled_sharded_step_has_no_collectives():
    assert "6 checks passed" in _run("hlo")


def test_pallas_kernels_cross_lower_for_cuda_under_shard_map():
    assert "2 checks passed" in _run("pallas_cuda")


def test_sharded_store_verbs_per_shard():
    assert "2 checks passed" in _run("store")


def test_host_tier_per_shard_offload_restore():
    assert "1 checks passed" in _run("host")
