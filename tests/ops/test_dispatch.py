"""Implementation selection: names, auto per platform, fallback warning, registry overrides."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_kv import ops
from ninfer_kv.ops import dispatch, reference
from ninfer_kv.ops.dispatch import ImplFallbackWarning, ImplUnavailableError, OpImpl, override_impls

from .cases import make_paged_case


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
        dispatch.resolve_impl("triton")
    case, q, rows, pos, lens = _small_case()
    with pytest.raises(ValueError, match="impl='cuda' is unknown"):
        ops.paged_attention(q, case.view(), rows, pos, lens, impl="cuda")
    with pytest.raises(TypeError, match="impl must be a string"):
        dispatch.resolve_impl(None)


def test_auto_picks_per_platform():
    loaders = {"ffi": _renamed_reference("ffi"), "pallas": _renamed_reference("pallas")}
    with override_impls(loaders):
        assert dispatch.resolve_impl("auto", platform="cpu").name == "ffi"
        assert dispatch.resolve_impl("auto", platform="gpu").name == "pallas"
        assert dispatch.resolve_impl("auto", platform="cuda").name == "pallas"
        with pytest.raises(ValueError, match="impl='auto' has no preference for platform 'tpu'"):
            dispatch.resolve_impl("auto", platform="tpu")
        # the default platform is the default backend's
        expected = "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "ffi"
        assert dispatch.resolve_impl().name == expected


def test_fallback_warns_once_and_runs_the_reference():
    case, q, rows, pos, lens = _small_case()
    want = jax.jit(reference.paged_attention_reference)(q, case.view(), rows, pos, lens)
    with override_impls({"ffi": _unavailable()}):
        with pytest.warns(ImplFallbackWarning, match="falling back to 'reference' because .*simulated: library not built"):
            out = jax.jit(lambda *a: ops.paged_attention(*a, impl="auto"))(q, case.view(), rows, pos, lens)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise
            assert dispatch.resolve_impl("auto", platform="cpu").name == "reference"
    # the override is scoped: the original loaders are back
    assert dispatch.registered_impls() == ("reference", "pallas", "ffi")


def test_explicit_unavailable_impl_is_a_clear_error():
    with override_impls({"ffi": _unavailable("the XLA FFI library did not load")}):
        with pytest.raises(ImplUnavailableError, match="did not load"):
            dispatch.resolve_impl("ffi")
    with override_impls({"pallas": _unavailable()}):
        with pytest.raises(ImplUnavailableError, match="no implementation could load"):
            dispatch.resolve_impl("auto", platform="gpu")


def test_missing_ffi_module_error_says_how_to_rebuild():
    if "ffi" in dispatch.available_impls():
        pytest.skip("the FFI library is built here")
    with pytest.raises(ImplUnavailableError, match=r"pip install -e \.|impl='reference'"):
        dispatch.resolve_impl("ffi")


def test_registered_impl_is_called_through_the_ops():
    calls = []
    base = OpImpl.from_module("reference", reference, suffix="_reference")

    def counting(*args, **kwargs):
        calls.append(len(args))
        return base.paged_attention(*args, **kwargs)

    loader = lambda: OpImpl("counting", base.paged_append, counting, base.cyclic_append, base.cyclic_attention)  # noqa: E731
    case, q, rows, pos, lens = _small_case()
    with override_impls({"counting": loader}, preference={"cpu": ("counting",), "gpu": ("counting",)}):
        assert "counting" in dispatch.registered_impls()
        jax.jit(lambda *a: ops.paged_attention(*a, impl="counting"))(q, case.view(), rows, pos, lens)
        jax.jit(lambda *a: ops.paged_attention(*a))(q, case.view(), rows, pos, lens)  # auto prefers it now
    assert calls == [5, 5]
    assert "counting" not in dispatch.registered_impls()


def test_register_impl_rejects_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register_impl("reference", _renamed_reference("reference"))
    with pytest.raises(ValueError, match="'auto'"):
        dispatch.register_impl("auto", _renamed_reference("auto"))
    with pytest.raises(TypeError, match="must be callable"):
        dispatch.register_impl("x", None)


def test_loader_missing_a_function_is_unavailable():
    import types

    partial = types.ModuleType("partial_kernels")
    partial.paged_append = partial.paged_attention = partial.cyclic_append = lambda *a, **k: None
    with pytest.raises(ImplUnavailableError, match="does not define cyclic_attention"):
        OpImpl.from_module("partial", partial)


@pytest.mark.parametrize("impl", [pytest.param("pallas", marks=pytest.mark.slow), "ffi"])  # Pallas: tests/pallas
def test_kernel_impl_matches_reference_when_available(impl):
    if impl not in dispatch.available_impls():
        pytest.skip(f"implementation {impl!r} is not available here")
    case, q, rows, pos, lens = _small_case()
    want = jax.jit(lambda *a: ops.paged_attention(*a, impl="reference"))(q, case.view(), rows, pos, lens)
    got = jax.jit(lambda *a: ops.paged_attention(*a, impl=impl))(q, case.view(), rows, pos, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
