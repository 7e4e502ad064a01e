"""``LLM`` over the windowed families' checkpoints written by transformers: Gemma 2 and Gemma 3 (sliding
windows shorter than the prompts, soft caps, Gemma's norms and MLP), Mistral (every layer slides over
80 tokens) and Qwen2 (``use_sliding_window``: the layers from ``max_window_layers`` on slide).
``generate`` and ``chat`` produce transformers' greedy tokens (up to reported near ties), the chat
prompt is what transformers' ``apply_chat_template`` renders, and prefix caching changes nothing but
the work (with window rings, a reuse resumes from the checkpoint's ring snapshot).  The shared pieces
are :mod:`.family_checkpoints`'s and :mod:`.llm_family_cases`'s."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from .family_checkpoints import FAMILY_TEXT  # noqa: E402
from .llm_family_cases import (  # noqa: E402
    check_chat,
    check_generate,
    check_prefix_caching,
    served_family,
)

FAMILIES = ("gemma2", "gemma3", "mistral", "qwen2")
served = served_family(FAMILIES)


def _slow_but(*default):
    """Every family, those not in ``default`` behind ``-m slow`` (the default run keeps one of each
    kind: Gemma 3 with rings, Qwen2 with rings over part of its layers)."""
    return [f if f in default else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_equals_transformers(family, served):
    check_generate(family, served)


@pytest.mark.parametrize("family", _slow_but("gemma3", "mistral"))
def test_chat_renders_as_transformers_and_answers_as_it(family, served):
    check_chat(family, served)


@pytest.mark.parametrize("family", _slow_but("gemma3", "qwen2"))
def test_prefix_caching_serves_the_same_tokens(family, served):
    check_prefix_caching(family, served)


def test_gemma2_template_refuses_a_system_turn(served):
    from ninfer_kv.engine.chat_template import ChatTemplateError

    llm = served("gemma2").llm
    assert "raise_exception('System role not supported')" in FAMILY_TEXT["gemma2"][0]
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def test_the_ring_models_keep_their_windowed_layers_in_rings(served):
    """Gemma and the partly windowed Qwen2 plan window rings; Mistral, every layer windowed, keeps them
    all in the Main pool."""
    rings = {family: served(family).llm.plan.rings for family in FAMILIES}
    assert rings["mistral"] is None
    assert all(rings[f] is not None and rings[f].spec.snapshots == rings[f].rows for f in ("gemma2", "gemma3", "qwen2"))
