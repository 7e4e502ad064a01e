"""Sharded KV on 8 forced host devices, each family in its own subprocess (see worker.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(*checks: str, timeout: int = 240) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu",  # worker.py adds the 8 host devices to XLA_FLAGS
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), *checks], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    return proc.stdout + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def family():
    """The store, Host, HLO and lowering checks in one subprocess (one JAX start)."""
    return _run("hlo", "pallas_cuda", "store", "host", "resync")


def _passed(out: str, check: str, count: int) -> None:
    assert f"{check}: {count} checks passed" in out, out[-6000:]


def test_ops_bit_equal_to_one_device():
    """2x4: every profile once, the plane orders alternating (FFI, bit-equal codes and outputs); 8x1,
    1x8 and replicated heads with BF16 and K8V4, each in both orders over the meshes; the reference
    with K8V4 (every profile in both orders on every mesh: ``-m slow``)."""
    _passed(_run("ops_fast"), "ops_fast", 12)


@pytest.mark.slow
def test_ops_bit_equal_every_profile_every_mesh():
    _passed(_run("ops_all", timeout=900), "ops_all", 80)


def test_compiled_sharded_step_has_no_collectives(family):
    _passed(family, "hlo", 6)


def test_pallas_kernels_cross_lower_for_cuda_under_shard_map(family):
    _passed(family, "pallas_cuda", 2)


def test_sharded_store_verbs_per_shard(family):
    _passed(family, "store", 2)


def test_host_tier_per_shard_offload_restore(family):
    _passed(family, "host", 1)


def test_sharded_state_is_poisoned_and_resynced_per_shard(family):
    _passed(family, "resync", 1)
