"""transformers as the oracle of the sliding-window and Gemma families: tiny Gemma 2, Gemma 3, Mistral and
Qwen2 models built and saved by transformers (:func:`hf_fixtures.save_transformers_checkpoint`: windows of
48 and 80 tokens, shorter than the prompts, so windows start mid-page and cross page boundaries; Gemma's
soft caps small enough to change the result), loaded by ``ninfer_kv.models.hf`` and served through the
paged store, must produce transformers' tokens and logits.

transformers runs its *eager* attention throughout: its sdpa path silently drops Gemma 2's attention soft
cap.

* BF16: the tokens of ``model.generate(do_sample=False)`` up to reported near ties
  (:func:`hf_fixtures.compare_greedy`: within two bfloat16 steps by transformers' bfloat16 logits, or by
  the float32 logits of the same weights where bfloat16 rounding moved transformers' own), including a
  fork from a retained checkpoint cut inside a window.
* Float32: transformers' float32 model whose attention sees K and V rounded to bfloat16 (what the BF16
  profile stores) with its own scale, soft cap and sliding-window mask, against the checkpoint served in
  float32: every logit of every generated position within :data:`F32_LOGIT_TOL`, while transformers
  without the window or a soft cap is far outside it (so each option is exercised).

Gemma 2 and Gemma 3 by default, Mistral and Qwen2 under ``-m slow``: by default they are served against
transformers through the engine (tests/engine/test_llm_windowed_families.py).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise ImportError(f"the oracle tests need the 'oracle' extra in CI (pip install '.[oracle]'): {exc}") from exc
    pytest.skip(f"transformers/torch not installed ({exc}); pip install '.[oracle]' to run the oracle tests",
                allow_module_level=True)

from hf_fixtures import (  # noqa: E402
    WINDOW_FAMILIES,
    compare_greedy,
    float32_arbiter,
    load_transformers_model,
    save_transformers_checkpoint,
)

from ninfer_kv.models.generate import PagedGenerator  # noqa: E402
from ninfer_kv.models.hf import load_checkpoint  # noqa: E402

# the default run compares every windowed family with transformers through LLM
# (tests/engine/test_llm_windowed_families.py); this module adds float32 logits per family
pytestmark = pytest.mark.slow

NEW_TOKENS = 10
MAX_CONTEXT = 256
F32_LOGIT_TOL = 5e-3
"""Largest |served - transformers| float32 logit (logits of a few units).  The two differ by float32
rounding, which now and then rounds a K or V element to the neighbouring bfloat16 value: up to about
3e-3 on these models."""
F32_TIE = 1e-3
DEFAULT = ("gemma2", "gemma3")
FAMILY_PARAMS = [f if f in DEFAULT else pytest.param(f, marks=pytest.mark.slow) for f in WINDOW_FAMILIES]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, 320, n).tolist() for n in (5, 150, 190)]  # 190: two prefill chunks, three pages


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(family, dtype)``: the directory of the family's transformers checkpoint in ``dtype``."""
    made = {}

    def get(family: str, dtype: str):
        if (family, dtype) not in made:
            made[family, dtype] = save_transformers_checkpoint(family, tmp_path_factory.mktemp(f"{family}-{dtype}"),
                                                               dtype=dtype)
        return made[family, dtype]

    return get


def _reference(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().numpy()


@pytest.mark.slow  # the default run checks bf16 greedy tokens through LLM (test_llm_windowed_families.py)
@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_bf16_greedy_tokens_equal_transformers_eager(family, prompts, checkpoints):
    directory = checkpoints(family, "bfloat16")
    loaded = load_checkpoint(directory, dtype="bfloat16", max_context=MAX_CONTEXT)
    window = WINDOW_FAMILIES[family][2]["sliding_window"]
    assert loaded.config.sliding_window == window and "sliding_attention" in loaded.config.layer_types
    gen = PagedGenerator(loaded.params, loaded.config, max_context=MAX_CONTEXT, max_batch=4)
    seqs = gen.generate(prompts, max_new_tokens=NEW_TOKENS)
    # a fork: a retained checkpoint of the longest prompt's first 100 tokens (a window's keys on two pages)
    # continued with the whole prompt serves exactly what the whole prompt does
    parent = gen.add(prompts[2][:100], max_new_tokens=1, retain=True)
    gen.run()
    fork = gen.add(prompts[2], max_new_tokens=NEW_TOKENS, source=parent)
    gen.run()
    assert fork.generated == seqs[2].generated
    model = load_transformers_model(family, directory)
    exact = load_transformers_model(family, directory, "float32")  # the same weights, computed in float32
    compared = 0
    for prompt, seq in zip(prompts, seqs):
        ref, logits = _reference(model, prompt)
        compared += compare_greedy(f"{family} bf16 p{len(prompt)}", seq.generated, ref, logits,
                                   arbiter=float32_arbiter(exact, prompt, ref))
    assert compared >= len(prompts) * NEW_TOKENS // 2, f"{family}: only {compared} tokens compared before near ties"


def bf16_kv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers' eager attention over K and V rounded to bfloat16 (the BF16 profile), float32 elsewhere:
    scores times ``scaling``, ``softcap * tanh(s / softcap)``, the (sliding-window) mask, softmax."""
    group = query.shape[1] // key.shape[1]
    k = key.to(torch.bfloat16).float().repeat_interleave(group, 1)
    v = value.to(torch.bfloat16).float().repeat_interleave(group, 1)
    scores = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    assert attention_mask is not None  # eager's mask (registered below): causal, and the window of a sliding layer
    scores = scores + attention_mask[..., : k.shape[2]].float()
    out = torch.matmul(torch.softmax(scores, -1), v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("ninfer_kv_bf16_kv", bf16_kv_attention)
transformers.AttentionMaskInterface.register("ninfer_kv_bf16_kv", transformers.masking_utils.eager_mask)


@contextlib.contextmanager
def _without(model, option: str):
    """transformers' ``model`` computing without one of its options (for one forward without a cache):
    ``"window"`` (the sliding layers' mask made causal), ``"attention soft cap"`` or ``"final soft cap"``."""
    config = model.config
    if option == "window":
        saved, config.sliding_window = config.sliding_window, 10**6
    elif option == "final soft cap":
        saved, config.final_logit_softcapping = config.final_logit_softcapping, None
    else:
        attns = [layer.self_attn for layer in model.model.layers]
        saved = [a.attn_logit_softcapping for a in attns]
        for a in attns:
            a.attn_logit_softcapping = None
    try:
        yield model
    finally:
        if option == "window":
            config.sliding_window = saved
        elif option == "final soft cap":
            config.final_logit_softcapping = saved
        else:
            for a, cap in zip(attns, saved):
                a.attn_logit_softcapping = cap


def _logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_f32_logits_equal_a_bf16_kv_transformers(family, prompts, checkpoints):
    directory = checkpoints(family, "float32")
    loaded = load_checkpoint(directory, dtype="float32", max_context=MAX_CONTEXT)
    gen = PagedGenerator(loaded.params, loaded.config, max_context=MAX_CONTEXT, max_batch=4, keep_logits=True)
    seqs = gen.generate(prompts, max_new_tokens=NEW_TOKENS)
    model = load_transformers_model(family, directory, "float32", attn_implementation="ninfer_kv_bf16_kv")
    options = ["window"] + [name for name, value in (("attention soft cap", loaded.config.attn_soft_cap),
                                                     ("final soft cap", loaded.config.final_soft_cap)) if value]
    compared = 0
    for prompt, seq in zip(prompts, seqs):
        tokens = prompt + seq.generated
        want = _logits(model, tokens[:-1])[len(prompt) - 1:]  # transformers' logits where the served ones came from
        got = np.stack([np.asarray(x) for x in seq.logits])
        err = float(np.abs(got - want).max())
        assert err <= F32_LOGIT_TOL, f"{family} f32 p{len(prompt)}: logits differ from transformers' by {err:.2e}"
        ref, logits = _reference(model, prompt)
        compared += compare_greedy(f"{family} f32 p{len(prompt)}", seq.generated, ref, logits, tie=lambda _: F32_TIE)
        if prompt is prompts[-1]:  # transformers without each option is far from the served logits
            for option in options:
                with _without(model, option):
                    other = _logits(model, tokens[:-1])[len(prompt) - 1:]
                assert np.abs(other - got).max() > 100 * F32_LOGIT_TOL, f"{family}: the {option} changes nothing"
    assert compared >= len(prompts) * NEW_TOKENS // 2
