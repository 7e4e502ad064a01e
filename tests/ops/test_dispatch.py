"""Implementation selection: names, auto per platform, fallback warning, registry overrides."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.ops import dispatch, reference, registry
from ninfer_kv.ops import ImplFallbackWarning, ImplUnavailableError, OpImpl, override_impls

from tests.conformance.cases import make_paged_case


def _unavailable(reason="simulated: library not built"):
    def loader():
        raise ImplUnavailableError(reason)

    return loader


def _renamed_reference(name):
    """The reference functions registered under another name (a real, working implementation)."""
    return lambda: OpImpl.from_module(name, reference, suffix="_reference")


def _small_case():
    kv_lens = np.array([70, 0], np.int32)
    case = make_paged_case("int8-g64", "page-major", kv_lens=kv_lens, seed=1)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 4, 64)).astype(np.float32))
    return case, q, jnp.asarray(case.table_rows), jnp.asarray(kv_lens - 1).clip(0), jnp.asarray(kv_lens)


def test_unknown_impl_lists_allowed_names():
    with pytest.raises(ValueError, match=r"impl='triton' is unknown; allowed: auto, reference, pallas, ffi"):
        registry.resolve_impl("triton")
    case, q, rows, pos, lens = _small_case()
    with pytest.raises(ValueError, match="impl='cuda' is unknown"):
        ops.paged_attention(q, case.view(), rows, pos, lens, impl="cuda")
    with pytest.raises(TypeError, match="impl must be a string"):
        registry.resolve_impl(None)


def test_auto_picks_per_platform():
    loaders = {"ffi": _renamed_reference("ffi"), "pallas": _renamed_reference("pallas")}
    with override_impls(loaders):
        assert registry.resolve_impl("auto", platform="cpu").name == "ffi"
        assert registry.resolve_impl("auto", platform="gpu").name == "pallas"
        assert registry.resolve_impl("auto", platform="cuda").name == "pallas"
        with pytest.raises(ValueError, match="impl='auto' has no preference for platform 'rocm-x'"):
            registry.resolve_impl("auto", platform="rocm-x")
        # the default platform is the default backend's
        expected = "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "ffi"
        assert registry.resolve_impl().name == expected


def test_fallback_warns_once_and_runs_the_reference():
    case, q, rows, pos, lens = _small_case()
    want = jax.jit(reference.paged_attention_reference)(q, case.view(), rows, pos, lens)
    with override_impls({"ffi": _unavailable()}):
        with pytest.warns(ImplFallbackWarning, match="falling back to 'reference' because .*simulated: library not built"):
            out = jax.jit(lambda *a: ops.paged_attention(*a, impl="auto"))(q, case.view(), rows, pos, lens)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise
            assert registry.resolve_impl("auto", platform="cpu").name == "reference"
    # the override is scoped: the original loaders are back
    assert registry.registered_impls() == ("reference", "pallas", "ffi", "pallas_tpu")


def test_explicit_unavailable_impl_is_a_clear_error():
    with override_impls({"ffi": _unavailable("the XLA FFI library did not load")}):
        with pytest.raises(ImplUnavailableError, match="did not load"):
            registry.resolve_impl("ffi")
    with override_impls({"pallas": _unavailable()}):
        with pytest.raises(ImplUnavailableError, match="no implementation could load"):
            registry.resolve_impl("auto", platform="gpu")


def test_missing_ffi_module_error_says_how_to_rebuild():
    if "ffi" in registry.available_impls():
        pytest.skip("the FFI library is built here")
    with pytest.raises(ImplUnavailableError, match=r"pip install -e \.|impl='reference'"):
        registry.resolve_impl("ffi")


def test_registered_impl_is_called_through_the_ops():
    calls = []
    base = OpImpl.from_module("reference", reference, suffix="_reference")

    def counting(*args, **kwargs):
        calls.append(len(args))
        return base.paged_attention(*args, **kwargs)

    loader = lambda: OpImpl("counting", base.paged_append, counting, base.cyclic_append, base.cyclic_attention)  # noqa: E731
    case, q, rows, pos, lens = _small_case()
    with override_impls({"counting": loader}, preference={"cpu": ("counting",), "gpu": ("counting",)}):
        assert "counting" in registry.registered_impls()
        jax.jit(lambda *a: ops.paged_attention(*a, impl="counting"))(q, case.view(), rows, pos, lens)
        jax.jit(lambda *a: ops.paged_attention(*a))(q, case.view(), rows, pos, lens)  # auto prefers it now
    assert calls == [5, 5]
    assert "counting" not in registry.registered_impls()


def test_register_impl_rejects_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        registry.register_impl("reference", _renamed_reference("reference"))
    with pytest.raises(ValueError, match="'auto'"):
        registry.register_impl("auto", _renamed_reference("auto"))
    with pytest.raises(TypeError, match="must be callable"):
        registry.register_impl("x", None)


def test_loader_missing_a_function_is_unavailable():
    import types

    partial = types.ModuleType("partial_kernels")
    partial.paged_append = partial.paged_attention = partial.cyclic_append = lambda *a, **k: None
    with pytest.raises(ImplUnavailableError, match="does not define cyclic_attention"):
        OpImpl.from_module("partial", partial)


@pytest.mark.parametrize("impl", [pytest.param("pallas", marks=pytest.mark.slow), "ffi"])  # Pallas: tests/pallas
def test_kernel_impl_matches_reference_when_available(impl):
    if impl not in registry.available_impls():
        pytest.skip(f"implementation {impl!r} is not available here")
    case, q, rows, pos, lens = _small_case()
    want = jax.jit(lambda *a: ops.paged_attention(*a, impl="reference"))(q, case.view(), rows, pos, lens)
    got = jax.jit(lambda *a: ops.paged_attention(*a, impl=impl))(q, case.view(), rows, pos, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)


# -- the registry: a leaf module of (op, backend) entries -----------------------------------------


def test_the_registry_imports_no_backend():
    """Importing the registry (and the ops, which register the built-in backends) loads no kernel package."""
    import ast
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ninfer_kv.ops import registry

    tree = ast.parse(Path(registry.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert not relative, f"the registry imports package modules: {relative}"
    third_party = sorted(m for m in imported if m.split(".")[0] not in sys.stdlib_module_names | {"__future__", "jax"})
    assert not third_party, f"the registry imports {third_party}"

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\n"
        "import ninfer_kv.ops.registry as registry\n"
        "from ninfer_kv import ops\n"
        "assert ops.registered_impls() == ('reference', 'pallas', 'ffi', 'pallas_tpu'), ops.registered_impls()\n"
        "assert len(ops.registered_ops()) == 22\n"  # four ops of three backends, two of pallas_tpu, two ragged forms of each
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'pallas_kernels' or m.startswith('ninfer_kv.ops.ffi'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert proc.returncode == 0, f"importing the registry loaded backends: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def _tiny_paged_attention(q, view, table_rows, positions, kv_lens, *, sm_scale=None):
    """A backend of one op (a stand-in, not attention): ``positions + 1`` broadcast to the shape of ``q``."""
    return jnp.broadcast_to((positions + 1).astype(q.dtype)[:, None, None, None], q.shape)


def test_a_backend_for_one_op_is_selectable_and_listed():
    case, q, rows, pos, lens = _small_case()
    with override_impls():  # the registration below is scoped to the block
        registry.register_op("paged_attention", "tiny", _tiny_paged_attention)
        assert "tiny" in registry.registered_impls() and "tiny" in ops.registered_impls()
        assert registry.registered_ops("tiny") == (("paged_attention", "tiny"),)
        assert ("paged_attention", "tiny") in ops.registered_ops()
        assert "tiny" in registry.available_impls()
        out = jax.jit(lambda *a: ops.paged_attention(*a, impl="tiny"))(q, case.view(), rows, pos, lens)
        np.testing.assert_array_equal(np.asarray(out), np.broadcast_to((np.asarray(pos) + 1)[:, None, None, None], q.shape))
        k = jnp.zeros((2, 1, 2, 64), jnp.float32)
        with pytest.raises(ImplUnavailableError, match="'tiny' has no paged_append .*provides paged_attention"):
            ops.paged_append(case.view(), rows, pos, k, k, jnp.zeros((2,), jnp.int32), impl="tiny")
        with pytest.raises(ValueError, match="paged_attention of implementation 'tiny' is already registered"):
            registry.register_op("paged_attention", "tiny", _tiny_paged_attention)
        registry.register_op("paged_attention", "tiny", _tiny_paged_attention, replace=True)
        # auto takes "tiny"'s op and the ops it lacks from the next backend (with the fallback warning)
        with override_impls(preference={"cpu": ("tiny", "reference")}):
            with pytest.warns(ImplFallbackWarning, match="'tiny' does not provide paged_append, cyclic_append"):
                chosen = registry.resolve_impl("auto", platform="cpu")
            assert chosen.name == "tiny+reference" and chosen.paged_attention is _tiny_paged_attention
            assert chosen.paged_append is registry.load_impl("reference").paged_append
    assert "tiny" not in registry.registered_impls()
    with pytest.raises(ValueError, match="impl='tiny' is unknown"):
        registry.resolve_impl("tiny")


def test_register_backend_targets_load_lazily():
    with override_impls():
        registry.register_backend(
            "lazy",
            {"paged_attention": "ninfer_kv.ops.reference:paged_attention_reference",
             "paged_append": "ninfer_kv_no_such_module:paged_append"},
            hint="install ninfer_kv_no_such_module",
        )
        assert registry.registered_ops("lazy") == (("paged_append", "lazy"), ("paged_attention", "lazy"))
        with pytest.raises(ImplUnavailableError, match=r"'lazy' is unavailable: cannot import ninfer_kv_no_such_module .*; "
                                                      r"install ninfer_kv_no_such_module"):
            registry.resolve_impl("lazy")
        assert "lazy" not in registry.available_impls()
        registry.register_backend("checked", {"paged_attention": _tiny_paged_attention},
                                  check=lambda: "no such device here", hint="run it elsewhere")
        with pytest.raises(ImplUnavailableError, match="'checked' is unavailable: no such device here; run it elsewhere"):
            registry.resolve_impl("checked")
        registry.register_backend("checked", {"paged_attention": _tiny_paged_attention}, replace=True)
        assert registry.resolve_impl("checked").paged_attention is _tiny_paged_attention
        with pytest.raises(ValueError, match="unknown op 'paged_copy'"):
            registry.register_backend("bad", {"paged_copy": _tiny_paged_attention})
        with pytest.raises(ValueError, match="'module:attribute'"):
            registry.register_op("paged_attention", "bad", "no_colon")
    assert registry.registered_impls() == ("reference", "pallas", "ffi", "pallas_tpu")


def test_auto_on_a_tpu_takes_the_mosaic_kernels_and_the_reference_cyclic_ops():
    with override_impls():
        with pytest.warns(ImplFallbackWarning, match="'pallas_tpu' does not provide cyclic_append, cyclic_attention"):
            chosen = registry.resolve_impl("auto", platform="tpu")
        tpu = registry.load_impl("pallas_tpu")
        assert chosen.name == "pallas_tpu+reference"
        assert chosen.paged_append is tpu.paged_append and chosen.paged_attention is tpu.paged_attention
        assert chosen.cyclic_append is registry.load_impl("reference").cyclic_append
