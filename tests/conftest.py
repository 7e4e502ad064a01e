"""Shared pytest configuration.

JAX runs on the CPU platform unless the caller chose one: ``JAX_PLATFORMS`` is only set when it is
not already in the environment (``JAX_PLATFORMS=cuda python -m pytest ...`` runs on a GPU).  It is
set before JAX creates a backend, and mirrored into ``jax.config`` in case JAX was imported first.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the environment is set)

jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
