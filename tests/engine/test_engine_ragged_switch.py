"""Which rounds the engine runs ragged: only where the model's ops have native ragged kernels.

A backend whose :class:`~ninfer_kv.ops.registry.OpImpl` has no ``paged_append_ragged`` /
``paged_attention_ragged`` would run a ragged round one query per row (every prompt token reading
its row's keys again), so an engine over it runs rectangular prefill and decode units instead, and
still produces the tokens of the ragged engine and of the request served alone.  The FFI and the
reference register native ragged ops and get ragged rounds; ``impl="auto"`` is judged by what it
resolves to on the default backend.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ninfer_kv.engine import DecoderModel, SamplingParams
from ninfer_kv.engine.model import feeds_ragged_rounds
from ninfer_kv.ops import registry

from .engine_fixtures import VOCAB, check_engine, drain, loaded, make_llm, reference

NO_RAGGED = "ffi_without_ragged"


def _ffi_without_ragged():
    """A loader of the FFI's four ops with the ragged entries absent (still named ``ffi``, so the
    model's products stay packed as on the FFI); the FFI is loaded now, outside any override."""
    ffi = dataclasses.replace(registry.load_impl("ffi"), paged_append_ragged=None, paged_attention_ragged=None)
    return lambda: ffi


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(41)
    return {rid: [int(t) for t in rng.integers(0, VOCAB, n)] for rid, n in (("short", 20), ("long", 150))}


def _serve(engine, prompts: dict, max_tokens: int = 6) -> dict[str, list[int]]:
    """Serve the short prompt, then the long one beside its decodes; the generated tokens by id."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.add_request("short", prompts["short"], params)
    engine.step()
    engine.add_request("long", prompts["long"], params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        check_engine(engine)
    return done


def test_a_backend_without_native_ragged_ops_gets_rectangular_rounds_and_the_same_tokens():
    prompts = _prompts()
    ragged = make_llm(max_num_batched_tokens=64).engine
    assert ragged.ragged_rounds
    want = _serve(ragged, prompts)
    assert ragged.stats.ragged_units > 0
    m = loaded()
    with registry.override_impls({NO_RAGGED: _ffi_without_ragged()}):
        model = DecoderModel(m.params, m.config, impl=NO_RAGGED)
        assert model.runs_ragged_natively is False and not feeds_ragged_rounds(model)
        engine = make_llm(model=model, max_num_batched_tokens=64).engine
        assert not engine.ragged_rounds and not engine.runner.runs_ragged
        got = _serve(engine, prompts)
    stats = engine.stats
    assert stats.ragged_units == 0 and "ragged" not in engine.runner.log.units, engine.runner.log.units
    assert stats.prefill_units > 0 and stats.decode_units > 0, stats
    assert got == want
    for rid, prompt in prompts.items():
        assert got[rid] == reference().greedy(prompt, 6), rid


def test_the_reference_backend_gets_ragged_rounds():
    m = loaded()
    model = DecoderModel(m.params, m.config, impl="reference")
    assert model.runs_ragged_natively
    engine = make_llm(model=model).engine
    assert engine.ragged_rounds
    prompt = _prompts()["short"]
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    done = drain(engine)
    assert engine.stats.ragged_units > 0 and engine.stats.prefill_units == 0
    assert done["r"].outputs[0].token_ids == reference().greedy(prompt, 3)


def test_auto_is_judged_by_what_it_resolves_to_on_the_default_backend():
    m = loaded()
    for impl in ("auto", "ffi", "reference"):
        assert DecoderModel(m.params, m.config, impl=impl).runs_ragged_natively, impl
    with registry.override_impls({"ffi": _ffi_without_ragged()}):  # auto on a CPU: the FFI first
        assert DecoderModel(m.params, m.config, impl="auto").runs_ragged_natively is False
        assert DecoderModel(m.params, m.config, impl="reference").runs_ragged_natively
    with registry.override_impls({NO_RAGGED: _ffi_without_ragged()}, preference={"cpu": ("reference",)}):
        assert DecoderModel(m.params, m.config, impl="auto").runs_ragged_natively


def test_a_mesh_model_and_models_that_say_no_get_no_ragged_rounds():
    m = loaded()
    assert DecoderModel(m.params, m.config, mesh=object()).runs_ragged_natively is False

    class Model:
        draft_window = 0

        def ragged(self, *args):
            raise AssertionError("not called")

    model = Model()
    assert feeds_ragged_rounds(model)  # a model of its own with a ragged call: native unless it says not
    model.runs_ragged_natively = False
    assert not feeds_ragged_rounds(model)
    model.runs_ragged_natively = "yes"
    with pytest.raises(TypeError, match="runs_ragged_natively='yes'"):
        feeds_ragged_rounds(model)
    model.runs_ragged_natively = True
    model.ragged = None
    assert not feeds_ragged_rounds(model)  # no ragged call
