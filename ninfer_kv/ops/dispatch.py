"""The built-in backends of the paged and cyclic ops.

The registry itself is :mod:`ninfer_kv.ops.registry` (one table of ``(op, backend)`` entries, a
leaf module, and the registry API); this module registers the built-in backends in it, one
:func:`~ninfer_kv.ops.registry.register_backend` call each, with ``"module:attribute"`` targets,
so nothing is imported until a backend is first used.

Built-in names:

* ``"reference"`` — :mod:`ninfer_kv.ops.reference` (gather-based jnp, for tests).
* ``"pallas"`` — the top-level ``pallas_kernels`` package (Pallas kernels on the Triton backend;
  interpret mode on a CPU backend).  With native ragged forms.
* ``"ffi"`` — :mod:`ninfer_kv.ops.ffi` (C++ XLA FFI CPU kernels); available when its native library
  loaded (:func:`ninfer_kv.ops.ffi.handlers.unavailable_reason`).  With native ragged forms.
* ``"pallas_tpu"`` — :mod:`pallas_kernels.mosaic_tpu` (Pallas kernels on Mosaic TPU: the two paged
  ops; TPU interpret mode on a CPU).  With native ragged forms.

``impl="auto"`` walks the preference list of the default backend's platform
(:data:`AUTO_PREFERENCE`): Pallas on GPU; FFI on CPU, falling back to the reference with a
:class:`ImplFallbackWarning` (issued once per platform and implementation) when the FFI library is
missing; on TPU the Mosaic paged ops, with the cyclic ops from the reference (one warning).  A later backend (e.g. Pallas on Mosaic GPU) is its files plus one
:func:`register_backend` call (and an entry in the preference list to make ``auto`` pick it).

:func:`override_impls` swaps loaders and preferences inside a ``with`` block (tests, experiments);
it also scopes the warn-once memory so a fallback warning inside the block is always observable.
"""

from __future__ import annotations

from .registry import OP_NAMES, RAGGED_OP_NAMES, register_backend

__all__ = [
]

REBUILD_HINT = (
    "build the native library with `pip install -e .` (or `pip install .`) from the repository root "
    "(CMake and a C++17 compiler are needed), or pass impl='reference' (slow, for tests)"
)

# -- built-in backends (nothing is imported here: targets load on first use) ---------------------

register_backend("reference", {op: f"ninfer_kv.ops.reference:{op}_reference" for op in OP_NAMES + RAGGED_OP_NAMES})
register_backend(
    "pallas",
    {op: f"pallas_kernels:{op}" for op in OP_NAMES + RAGGED_OP_NAMES},
    hint="install the package with its pallas_kernels directory",
)
register_backend(
    "ffi",
    {op: f"ninfer_kv.ops.ffi.kv:{op}" for op in OP_NAMES + RAGGED_OP_NAMES},
    check="ninfer_kv.ops.ffi.handlers:unavailable_reason",
    hint=REBUILD_HINT,
)
register_backend(
    "pallas_tpu",
    {
        "paged_append": "pallas_kernels.mosaic_tpu.paged_append:paged_append",
        "paged_attention": "pallas_kernels.mosaic_tpu.paged_attention:paged_attention",
        "paged_append_ragged": "pallas_kernels.mosaic_tpu.ragged:paged_append_ragged",
        "paged_attention_ragged": "pallas_kernels.mosaic_tpu.ragged:paged_attention_ragged",
    },
    hint="install the package with its pallas_kernels directory and a JAX with Pallas TPU support",
)
