"""The checks tests/engine/test_llm_windowed_families.py runs for each family (see
:mod:`.family_checkpoints` for the checkpoints and the oracle)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ninfer_kv.engine import LLM, SamplingParams

from .family_checkpoints import (
    CONVERSATIONS,
    MAX_MODEL_LEN,
    TransformersGreedy,
    characters,
    compare_greedy,
    transformers_render,
    write_text_checkpoint,
)

MAX_NUM_SEQS = 4
MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


@dataclasses.dataclass
class Served:
    """A family's text checkpoint, an ``LLM`` over it and transformers' greedy oracle."""

    family: str
    directory: Path
    llm: LLM
    oracle: TransformersGreedy


def make_llm(directory: Path, **kwargs) -> LLM:
    return LLM(str(directory), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               kv_capacity=MAX_NUM_SEQS * MAX_MODEL_LEN, **kwargs)


def served_family(families):
    """A module fixture ``served(family) -> Served`` (each family built once per module)."""

    @pytest.fixture(scope="module")
    def served(tmp_path_factory):
        made: dict[str, Served] = {}

        def get(family: str) -> Served:
            assert family in families
            if family not in made:
                directory = write_text_checkpoint(family, tmp_path_factory.mktemp(family))
                made[family] = Served(family, directory, make_llm(directory), TransformersGreedy(family, directory))
            return made[family]

        return get

    return served


def _check_tokens(what: str, served: Served, prompt_ids, token_ids) -> int:
    ref, logits = served.oracle(prompt_ids, len(token_ids))
    return compare_greedy(f"{served.family} {what}", list(token_ids), ref, logits,
                          arbiter=served.oracle.arbiter(prompt_ids, ref))


def check_generate(family: str, get) -> None:
    served = get(family)
    llm = served.llm
    assert llm.engine.model.config.dtype == "bfloat16" and llm.model_config.sliding_window is not None
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 300, n).tolist() for n in (7, 150, 200)]  # one batch: the longer two outgrow the window
    outs = llm.generate(prompts, greedy())
    compared = 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt and len(out.outputs[0].token_ids) == MAX_TOKENS
        compared += _check_tokens(f"generate p{len(prompt)}", served, prompt, out.outputs[0].token_ids)
    assert compared >= len(prompts) * MAX_TOKENS // 2, f"{family}: only {compared} tokens compared before near ties"
    # a text prompt: the characters of the ids, and the text of the answer
    chars = characters(family)
    text = "".join(chars[i] for i in prompts[1][:120] if i < 256)
    out = llm.generate(text, greedy())[0]
    assert out.prompt_token_ids == [chars.index(c) for c in text]
    assert out.outputs[0].text == "".join(chars[i] for i in out.outputs[0].token_ids)


def check_chat(family: str, get) -> None:
    served = get(family)
    conversation = CONVERSATIONS[family]
    out = served.llm.chat(conversation, greedy())[0]
    text, ids = transformers_render(family, served.directory, conversation)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert len(ids) > max(w for w in (48, 80))  # the prompt alone is longer than the window
    answer = out.outputs[0]
    assert _check_tokens("chat", served, ids, answer.token_ids) >= MAX_TOKENS // 2
    chars = characters(family)
    assert answer.text == "".join(chars[i] for i in answer.token_ids)


def check_prefix_caching(family: str, get) -> None:
    served = get(family)
    cached, uncached = served.llm, make_llm(served.directory, enable_prefix_caching=False)
    rng = np.random.default_rng(12)
    prefix = rng.integers(0, 300, 140).tolist()  # two full pages and part of a third
    prompts = [prefix + rng.integers(0, 300, n).tolist() for n in (20, 45)]
    cached.clear_cache()
    on = [cached.generate([p], greedy(6))[0] for p in prompts]  # one after the other: the second finds the prefix
    off = [uncached.generate([p], greedy(6))[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert on[1].num_cached_tokens >= 128 and off[1].num_cached_tokens == 0
