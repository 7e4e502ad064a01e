"""The example model runs on every available op implementation and matches the dense reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from model_harness import greedy_decode, make, prefill, random_tables
from ninfer_kv.models.decoder import ModelConfig, dense_greedy_generate, init_params
from ninfer_kv.ops import available_impls
from ninfer_kv.ops.views import allocate_planes

TOL_KERNEL = 1e-3  # kernel implementations vs the dense float32 reference (observed ~3e-5 on CPU)


def _available() -> tuple[str, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return available_impls()


@pytest.mark.parametrize("impl, profile", [("ffi", "bf16"), ("ffi", "k8v4"), ("pallas", "bf16"),
                                           pytest.param("pallas_tpu", "k8v4", marks=pytest.mark.slow)])
def test_paged_steps_on_kernel_impls_match_dense(impl, profile):
    if impl not in _available():
        pytest.skip(f"implementation {impl!r} is not available here")
    cfg = ModelConfig.tiny()
    params = init_params(cfg, seed=1)
    steps = make(cfg, profile, impl=impl)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, cfg.vocab_size, (2, 150)).astype(np.int32)
    tables = random_tables(rng, 4, 4, 21)
    planes = allocate_planes(steps.config.main_layout, 21)
    planes, first = prefill(steps, params, planes, tables, prompt, [3, 1])
    planes, toks, logits, _ = greedy_decode(steps, params, planes, tables, first.next_tokens, 150, [3, 1], 3)
    dense_tokens, dense_logits = dense_greedy_generate(params, cfg, prompt, 4, profile)
    np.testing.assert_array_equal(np.concatenate([np.asarray(first.next_tokens)[:, None], toks], 1), np.asarray(dense_tokens))
    paged_logits = np.concatenate([np.asarray(first.logits)[:, None], logits], 1)
    np.testing.assert_allclose(paged_logits, np.asarray(dense_logits), atol=TOL_KERNEL, rtol=0)
    assert steps.compiles() == {"prefill": 1, "decode": 1, "verify": 0, "ragged": 0, "prefill_state": 0, "decode_state": 0,
                                "verify_state": 0, "ragged_state": 0}


def test_ffi_decode_temp_memory_does_not_grow_with_context():
    """No staging copy proportional to context: the decode step's temporaries are independent of L and N."""
    if "ffi" not in _available():
        pytest.skip("the FFI implementation is not available here")
    from ninfer_kv.models.decoder import StepConfig, make_steps

    cfg = ModelConfig.tiny()
    params = init_params(cfg, seed=0)
    steps = make_steps(StepConfig(model=cfg, impl="ffi"))
    temp = []
    for blocks in (4, 64):
        num_pages = 2 * blocks + 1
        planes = allocate_planes(steps.config.main_layout, num_pages)
        tables = np.zeros((2, blocks), np.int32)
        one = np.ones((2,), np.int32)
        compiled = steps.decode.lower(params, planes, tables, np.zeros((2, 1), np.int32), one, one, one).compile()
        temp.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temp[0] == temp[1], temp
    assert steps.decode.compiles == 2


def test_step_config_takes_every_registered_impl_and_names_them_when_refusing():
    """``StepConfig.impl`` is any name of the op registry (``pallas_tpu`` and a caller's own), nothing else."""
    from ninfer_kv.demo.config import DemoConfig
    from ninfer_kv.models.decoder import StepConfig
    from ninfer_kv.ops import registry

    cfg = ModelConfig.tiny()
    for impl in registry.impl_choices():
        assert StepConfig(model=cfg, impl=impl).impl == impl
    reference = registry.load_impl("reference")
    with registry.override_impls({"mine": lambda: reference}):
        assert StepConfig(model=cfg, impl="mine").impl == "mine"
        assert DemoConfig(impl="mine").impl == "mine"
    allowed = ", ".join(registry.impl_choices())
    with pytest.raises(ValueError, match=f"impl='mine' is not supported; allowed: {allowed}$"):
        StepConfig(model=cfg, impl="mine")
    with pytest.raises(ValueError, match=f"impl='cuda' is not supported; allowed: {allowed}$"):
        DemoConfig(impl="cuda")
