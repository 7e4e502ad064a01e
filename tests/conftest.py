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

Compiled programs go to a persistent compilation cache shared by the session's worker processes
(a temporary directory made by the first process and removed when it exits) unless
``JAX_COMPILATION_CACHE_DIR`` is set: many tests build fresh ``jax.jit`` wrappers of the same
computations (a model's steps, an op at a shape), and a program compiled once is then loaded, not
compiled again, in every other test and worker.

The suite's longest modules are collected first (``HEAVY_FIRST``): pytest-xdist hands whole
modules to its workers in collection order, so a long module collected last would leave one core
idle at the end of the run.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="ninfer-kv-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache  # inherited by the xdist workers
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the environment is set)
import pytest  # noqa: E402

jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


HEAVY_FIRST = (
    "tests/engine/test_llm_windowed_families.py",
    "tests/engine/test_engine_core.py",
    "tests/engine/test_engine_speculative.py",
    "tests/server/test_openai_api.py",
    "tests/engine/test_engine_state_machine.py",
    "tests/test_docs.py",
    "tests/conformance/test_ragged.py",
    "tests/demo/test_demo_serving.py",
    "tests/ffi/test_gemm_packed.py",
    "tests/conformance/test_paged_attention.py",
    "tests/examples/test_model_paged_steps.py",
    "tests/models/test_generate_cli.py",
    "tests/models/test_hf_oracle.py",
    "tests/models/test_decoder_windows.py",
    "tests/engine/test_ring_reuse.py",
    "tests/models/test_ragged_step.py",
    "tests/ffi/test_ffi_attention_variants.py",
    "tests/store/test_state_machine.py",
    "tests/ffi/test_neon_emulated.py",
    "tests/mesh/test_sharded.py",
    "tests/mesh/test_demo_mesh.py",
)
"""Modules that take the longest (seconds of CPU each, measured), collected before the others."""


STAGES = {
    "interpreted": ("tests/pallas/", "tests/pallas_tpu/", "tests/ffi/test_neon_emulated.py", "tests/ffi/test_ffi_levels.py",
                    "tests/ffi/test_gemm_packed.py::test_levels_and_bf16_form_bit_identical",
                    "tests/ffi/test_gemm_packed.py::test_compiles_for_aarch64"),
    "multidevice": ("tests/mesh/",),
}
"""The tests of a separate stage (deselected by ``python -m pytest``; CI runs them with ``-m
"interpreted or multidevice"``; an entry is a folder, a file or a test): the kernels run as other targets run them — the Pallas GPU and TPU
kernels in their CPU interpreters (these folders, and every case of a ``backend`` fixture set to
``"pallas"`` or ``"pallas_tpu"``), the NEON kernels under qemu and each forced x86 level of the FFI
library — and the cache on forced multi-device meshes and processes."""

_INTERPRETED_BACKENDS = ("pallas", "pallas_tpu")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, prefixes in STAGES.items():
            if item.nodeid.startswith(prefixes):
                item.add_marker(getattr(pytest.mark, marker))
        if getattr(getattr(item, "callspec", None), "params", {}).get("backend") in _INTERPRETED_BACKENDS:
            item.add_marker(pytest.mark.interpreted)
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order inside each group is kept
