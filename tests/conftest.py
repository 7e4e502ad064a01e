"""Shared pytest configuration.

JAX runs on the CPU platform unless the caller chose one: ``JAX_PLATFORMS`` is only set when it is
not already in the environment (``JAX_PLATFORMS=cuda python -m pytest ...`` runs on a GPU).  It is
set before JAX creates a backend, and mirrored into ``jax.config`` in case JAX was imported first.

XLA's CPU backend compiles the suite's programs at LLVM optimization level 0 unless ``XLA_FLAGS``
already names a level: the tests' programs are tiny, so compiling them costs far more than running
them (the Pallas interpret-mode kernels compile about a third faster).  Float semantics do not
depend on the level (XLA's CPU fast-math is off at every level, so LLVM may not reorder float
arithmetic), and the exactness tests hold at both levels:
``XLA_FLAGS=--xla_backend_optimization_level=3 python -m pytest`` runs the suite at XLA's default.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402  (after the environment is set)

jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
