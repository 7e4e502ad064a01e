"""LLM over a checkpoint directory with a tokenizer: text in and out, stop strings, chat, the prompt
forms ``generate`` takes, all-or-nothing refusals, and the automatic KV capacity.

The tokenizer is built here: a character-level BPE (no merges) whose 256 tokens are 256 distinct
characters, so every token id the model may produce decodes to exactly one character and text
encodes back to the same ids (a conversation's next turn holds the previous answer's very ids).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ninfer_kv.engine import LLM, SamplingParams
from ninfer_kv.schema.geometry import PAGE_SIZE
from store.helpers import assert_same

from .engine_fixtures import MAX_MODEL_LEN, MAX_NUM_SEQS, VOCAB, assert_store_empty, check_engine, make_llm, reference
from .engine_fixtures import write_model_files

tokenizers = pytest.importorskip("tokenizers")

CHARS = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(0x100 + i) for i in range(VOCAB - 96)]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    directory = write_model_files(tmp_path_factory.mktemp("llama-text"))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = tokenizers.decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def llm(text_checkpoint):
    return LLM(str(text_checkpoint), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               kv_capacity=MAX_NUM_SEQS * MAX_MODEL_LEN)


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def decode(ids) -> str:
    return "".join(CHARS[i] for i in ids)


def test_text_prompts_generate_the_text_of_the_tokens(llm):
    prompt = "The paged KV cache serves many requests at once. " * 2
    out = llm.generate(prompt, greedy(8))[0]
    assert llm.engine.model.config.dtype == "float32"  # dtype="auto" keeps a float32 checkpoint
    assert out.prompt == prompt and out.prompt_token_ids == encode(prompt)
    c = out.outputs[0]
    assert c.token_ids == reference().greedy(encode(prompt), 8)
    assert c.text == decode(c.token_ids) and c.finish_reason == "length" and c.stop_reason is None
    # log-probabilities name each token's text
    out = llm.generate(prompt, greedy(3, logprobs=1))[0]
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry[tok].decoded_token == CHARS[tok]
    check_engine(llm.engine)


def test_a_stop_string_ends_the_text_before_it(llm):
    prompt = "Stop strings cut the text: "
    want = reference().greedy(encode(prompt), 8)
    text = decode(want)
    k = next(i for i in range(1, 6) if text.find(text[i: i + 2]) == i)  # a 2-token string first found at i
    stop = text[k: k + 2]
    out = llm.generate(prompt, greedy(8, stop=[stop, "never-there"]))[0]
    c = out.outputs[0]
    assert c.text == text[:k] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == want[: k + 2]  # up to the token that completed the stop string
    # a stop string that never appears: the whole text
    out = llm.generate(prompt, greedy(8, stop="ǅǅǅǅ"))[0]
    assert out.outputs[0].text == text and out.outputs[0].finish_reason == "length"
    # a stop token id: its text is left out, the id kept
    out = llm.generate(prompt, greedy(8, stop_token_ids=[want[2]]))[0]
    first = want.index(want[2])
    assert out.outputs[0].token_ids == want[: first + 1] and out.outputs[0].text == text[:first]
    assert out.outputs[0].stop_reason == want[2]


def test_chat_renders_the_template_and_a_second_turn_reuses_the_first(llm):
    llm.clear_cache()
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    rendered = "<|system|>You are terse.\n<|user|>Hello there\n<|assistant|>"
    out = llm.chat(turn1, greedy(6))[0]
    assert out.prompt == rendered and out.prompt_token_ids == encode(rendered)
    answer = out.outputs[0]
    assert answer.token_ids == reference().greedy(encode(rendered), 6)
    assert answer.text == decode(answer.token_ids)
    turn2 = turn1 + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "More"}]
    out2 = llm.chat(turn2, greedy(6))[0]
    assert out2.prompt.startswith(rendered + answer.text)
    assert out2.num_cached_tokens == len(encode(rendered)) + len(answer.token_ids) - 1
    assert out2.outputs[0].token_ids == reference().greedy(encode(out2.prompt), 6)
    # several conversations at once, one SamplingParams each
    outs = llm.chat([turn1, turn2], [greedy(2), greedy(3)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]
    assert outs[0].outputs[0].token_ids == answer.token_ids[:2]
    # without a generation prompt the template ends after the last message
    out = llm.chat(turn1, greedy(1), add_generation_prompt=False)[0]
    assert out.prompt == rendered[: -len("<|assistant|>")]


def test_generate_accepts_every_prompt_form_in_order(llm):
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    forms = ["a text prompt", ids, {"prompt": "a dict prompt"}, {"prompt_token_ids": ids[:5]}, np.array(ids[2:])]
    outs = llm.generate(forms, greedy(4))
    assert [o.prompt for o in outs] == ["a text prompt", None, "a dict prompt", None, None]
    want_ids = [encode("a text prompt"), ids, encode("a dict prompt"), ids[:5], ids[2:]]
    assert [o.prompt_token_ids for o in outs] == want_ids
    for o, p in zip(outs, want_ids):
        assert o.outputs[0].token_ids == reference().greedy(p, 4)
    # one token-id list is one prompt; a per-prompt SamplingParams list applies in order
    assert len(llm.generate(ids, greedy(1))) == 1
    outs = llm.generate([ids, ids[:6]], [greedy(2), greedy(5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)


def test_bad_calls_are_refused_before_anything_is_queued(llm):
    engine = llm.engine
    while engine.has_unfinished():
        engine.step()
    snap = engine.store.snapshot()
    rounds = engine.stats.rounds
    cases = [
        (ValueError, lambda: llm.generate(["a", "b", "c"], [greedy(1), greedy(1)])),  # mismatched params list
        (TypeError, lambda: llm.generate(["a", "b"], [greedy(1), {"max_tokens": 1}])),
        (ValueError, lambda: llm.generate([[1, 2], [VOCAB]], greedy(1))),  # the second prompt is out of range
        (ValueError, lambda: llm.generate({"neither": 1}, greedy(1))),
        (TypeError, lambda: llm.generate(3.5, greedy(1))),
        (ValueError, lambda: llm.generate("x" * MAX_MODEL_LEN, greedy(1))),
        (ValueError, lambda: llm.chat([{"role": "user"}], greedy(1))),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
        assert not engine.has_unfinished() and engine.waiting == []
        assert_same(snap, engine.store.snapshot())
    assert engine.stats.rounds - rounds <= 1  # at most the round that dropped a partly queued call


def test_a_model_without_a_tokenizer_takes_token_ids_only():
    llm = make_llm()
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text", greedy(1))
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    out = llm.generate([[1, 2, 3]], greedy(2))[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == reference().greedy([1, 2, 3], 2)
    assert llm.clear_cache() == 1
    assert_store_empty(llm.engine)


def test_automatic_kv_capacity_on_cpu(text_checkpoint):
    llm = LLM(str(text_checkpoint), max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    pages_per_row = -(-MAX_MODEL_LEN // PAGE_SIZE)
    assert pages_per_row <= llm.plan.m <= 2 * pages_per_row
    assert llm.engine.store.pool("main").capacity == llm.plan.m
    with pytest.raises(ValueError):
        LLM(str(text_checkpoint), max_model_len=MAX_MODEL_LEN, max_num_seqs=2, kv_capacity=PAGE_SIZE)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(text_checkpoint), max_model_len=10**6)
