"""``ninfer-kv serve`` through the official ``openai`` client: completions and chat completions, with
and without streaming, ``n``, seeds, stop strings, log-probabilities, prefix reuse reported as
``cached_tokens``, ``/v1/models``, ``/health``, ``/metrics`` and ``/reset_prefix_cache``.

One server serves the module (``--served-model-name tiny-llama``, a 256-token context, 8 rows).
Greedy results are checked against the engine itself: an in-process :class:`ninfer_kv.engine.LLM`
over the same checkpoint directory serving each prompt alone, so a server that batches requests,
reuses cached prefixes or streams must still return exactly the text the model produces.  The
tokenizer is character-level (see :mod:`.server_fixtures`): a completion of ``k`` tokens is ``k``
characters, and the greedy completion of ``m`` tokens is the first ``m`` characters of a longer one.
"""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .server_fixtures import (  # noqa: E402
    CHARS,
    decode,
    render_chat,
    scrape,
    wait_idle,
)

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
KV_CAPACITY = MAX_NUM_SEQS * MAX_MODEL_LEN
PAGE_TOKENS = 64
FLAGS = ("--served-model-name", MODEL, "--max-model-len", MAX_MODEL_LEN, "--max-num-seqs", MAX_NUM_SEQS,
         "--kv-capacity", KV_CAPACITY, "--seed", 0)
REF_TOKENS = 16
"""The longest greedy completion the tests compare (the reference computes this many per prompt)."""

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def reference(text_checkpoint):
    """``reference(prompt)``: the greedy :class:`~ninfer_kv.engine.CompletionOutput` of ``prompt`` (text
    or token ids): :data:`REF_TOKENS` tokens with two log-probability alternatives each, the prompt
    served alone by an in-process engine over the same checkpoint."""
    from ninfer_kv.engine import LLM, SamplingParams

    llm = LLM(str(text_checkpoint), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, kv_capacity=KV_CAPACITY)
    cache: dict = {}

    def run(prompt):
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        if key not in cache:
            out = llm.generate(prompt if isinstance(prompt, str) else [list(prompt)],
                               SamplingParams(max_tokens=REF_TOKENS, temperature=0.0, logprobs=2))[0].outputs[0]
            assert out.text == decode(out.token_ids)
            cache[key] = out
        return cache[key]

    return run


def greedy_text(reference, prompt, max_tokens: int) -> str:
    assert max_tokens <= REF_TOKENS
    return reference(prompt).text[:max_tokens]


def sse_events(response) -> list[str]:
    """The ``data:`` payloads of a server-sent-event response, in order."""
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    events, data = [], []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line == "" and data:
            events.append("\n".join(data))
            data = []
    if data:
        events.append("\n".join(data))
    return events


def cached_tokens(usage) -> int:
    assert usage.prompt_tokens_details is not None, f"usage has no prompt_tokens_details: {usage}"
    return usage.prompt_tokens_details.cached_tokens


# -- endpoints -----------------------------------------------------------------------------------------------------
def test_health_and_models_list_the_served_name(http, client):
    assert http.get("/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and [m["id"] for m in raw["data"]] == [MODEL]


def test_a_completion_has_openai_fields(client, reference):
    prompt = "Hello, paged world"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id and r.created > 0
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    assert c.text == greedy_text(reference, prompt, 8)
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(prompt), 8, len(prompt) + 8)
    assert isinstance(cached_tokens(u), int)
    # max_tokens defaults to 16
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].text == greedy_text(reference, prompt, 16)


def test_greedy_completions_equal_each_prompt_served_alone(client, reference):
    """Token-id prompts around page boundaries, sent at once (the server batches them): each text is
    the engine's greedy text of that prompt served alone."""
    rng = np.random.default_rng(0)
    lengths = [1, 7, 63, 64, 65, 140, 200, 30]
    max_tokens = [8, 16, 5, 12, 9, 16, 3, 16]
    prompts = [rng.integers(0, len(CHARS), n).tolist() for n in lengths]

    def complete(i):
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, range(len(prompts))))
    for p, m, r in zip(prompts, max_tokens, results):
        assert r.choices[0].text == greedy_text(reference, p, m), f"prompt of {len(p)} tokens"
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), m)

    # several prompts in one request: token-id lists, then the same prompts as text, with n = 2
    r = client.completions.create(model=MODEL, prompt=prompts[:3], max_tokens=5, temperature=0)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    got = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert got == [greedy_text(reference, p, 5) for p in prompts[:3]]
    assert r.usage.prompt_tokens == sum(lengths[:3]) and r.usage.completion_tokens == 15
    texts = [decode(p) for p in prompts[1:3]]
    r = client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0, n=2)
    got = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    want = [greedy_text(reference, prompts[1], 4)] * 2 + [greedy_text(reference, prompts[2], 4)] * 2
    assert got == want, "choice i * n + j is completion j of prompt i"
    assert r.usage.completion_tokens == 16


def test_a_streamed_completion_is_the_response_in_pieces(http, client, reference):
    prompt = "Streaming sends the same tokens: "
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1, "every chunk carries the completion's id"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == len(prompt)
    assert usage_chunk["usage"]["completion_tokens"] == 12 and usage_chunk["usage"]["total_tokens"] == len(prompt) + 12
    choices = [ch for c in chunks[:-1] for ch in c["choices"]]
    assert all(c.get("usage") is None for c in chunks[:-1]), "only the last chunk carries usage"
    assert "".join(ch["text"] for ch in choices) == greedy_text(reference, prompt, 12)
    reasons = [ch.get("finish_reason") for ch in choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])

    # the client's stream; without include_usage no usage chunk
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == greedy_text(reference, prompt, 12)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_renders_the_template_and_streams(client, reference):
    rendered = render_chat(CONVERSATION)
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length" and c.logprobs is None
    assert c.message.content == greedy_text(reference, rendered, 10)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(rendered), 10)
    assert r.usage.total_tokens == len(rendered) + 10
    # max_completion_tokens is max_tokens' newer name
    r6 = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_completion_tokens=6, temperature=0)
    assert r6.choices[0].message.content == c.message.content[:6] and r6.usage.completion_tokens == 6

    stream = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(k.object == "chat.completion.chunk" and k.model == MODEL for k in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(rendered)
    deltas = [k.choices[0] for k in chunks[:-1]]
    assert deltas[0].delta.role == "assistant", "the first delta names the role"
    assert "".join(d.delta.content or "" for d in deltas) == c.message.content
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])

    # the next turn holds the answer's tokens: all but the last are reused from the prefix cache
    turn2 = CONVERSATION + [{"role": "assistant", "content": c.message.content}, {"role": "user", "content": "More"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens == len(render_chat(turn2))
    assert cached_tokens(r2.usage) == len(rendered) + 10 - 1
    assert r2.choices[0].message.content == greedy_text(reference, render_chat(turn2), 4)


def test_n_completions_and_seeds(client, reference):
    prompt = "Sampling with a seed repeats: "
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert all(c.finish_reason == "length" and len(c.text) == 6 for c in first.choices)
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == len(prompt)
    again = client.completions.create(**kw)
    by_index = lambda r: [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # noqa: E731
    assert by_index(again) == by_index(first), "the same seed gives the same completions"
    # sampling restricted to the most likely token is greedy
    greedy = greedy_text(reference, prompt, 6)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=7,
                                  extra_body={"top_k": 1})
    assert r.choices[0].text == greedy, "top_k=1"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=7, top_p=1e-6)
    assert r.choices[0].text == greedy, "top_p=1e-6"
    # chat with n = 2 and the ignore_eos extension
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=3, n=2, temperature=0.8,
                                       seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 6


def first_new_pair(text: str) -> int:
    """An index ``k`` in ``[1, 6)`` where the 2 characters at ``k`` appear for the first time."""
    return next(i for i in range(1, 6) if text.find(text[i: i + 2]) == i)


def test_a_stop_string_cuts_the_text_before_it(client, reference):
    prompt = "Stop strings cut the text: "
    text = greedy_text(reference, prompt, 12)
    k = first_new_pair(text)
    stop = text[k: k + 2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "never-there"])
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens >= k
    # one string, 16 strings (the most allowed), and streamed (a partial match is held back, not sent)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    many = [stop] + [f"absent {i}" for i in range(15)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=many)
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:k]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # a stop string that never appears: the whole text, finish_reason "length"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop="ǅǅǅǅ")
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"

    # chat: the content is cut the same way, streamed or not
    content = greedy_text(reference, render_chat(CONVERSATION), 12)
    k = first_new_pair(content)
    stop = content[k: k + 2]
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].message.content == content[:k] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=12, temperature=0,
                                                 stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content[:k]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completion_logprobs_are_the_engines(client, reference):
    prompt = "Log-probabilities of each token: "
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    c = r.choices[0]
    want = reference(prompt)
    lp = c.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == c.text == want.text[:6]
    for i, (tok, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        chosen = want.token_ids[i]
        assert tok == CHARS[chosen]
        assert value <= 0 and value == pytest.approx(want.logprobs[i][chosen].logprob, abs=2e-3)
        assert len(top) == 2, f"top_logprobs[{i}] = {top}: 2 alternatives asked for"
        best = max(top, key=top.get)
        assert best == tok and top[tok] == pytest.approx(value, abs=1e-6), "a greedy token is the most likely"
        ref_top = sorted(want.logprobs[i].items(), key=lambda kv: -kv[1].logprob)[:2]
        assert set(top) == {CHARS[t] for t, _ in ref_top}
        for t, entry in ref_top:
            assert top[CHARS[t]] == pytest.approx(entry.logprob, abs=2e-3)
    # logprobs=0: the chosen tokens' log-probabilities only
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.tokens == [CHARS[t] for t in want.token_ids[:3]]
    assert lp.token_logprobs == pytest.approx([want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids[:3])],
                                              abs=2e-3)


def test_chat_logprobs(client, reference):
    rendered = render_chat(CONVERSATION)
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    c = r.choices[0]
    want = reference(rendered)
    content = c.logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == c.message.content == want.text[:5]
    for i, t in enumerate(content):
        chosen = want.token_ids[i]
        assert t.token == CHARS[chosen] and t.logprob <= 0
        assert t.logprob == pytest.approx(want.logprobs[i][chosen].logprob, abs=2e-3)
        assert t.bytes is None or bytes(t.bytes) == t.token.encode()
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
        assert t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob


def test_a_repeated_prompt_reuses_all_but_its_last_token(client, http):
    prompt = "A long prompt that is sent twice, and reused from the prefix cache the second time. " * 2
    n = len(prompt)
    assert http.post("/reset_prefix_cache").status_code == 200  # no earlier prompt shares a prefix with it
    before = scrape(http)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == n and cached_tokens(first.usage) == 0
    mid = wait_idle(http)
    assert mid.get("ninfer_kv_prompt_tokens_total") - before.get("ninfer_kv_prompt_tokens_total") == n
    assert mid.get("ninfer_kv_generation_tokens_total") - before.get("ninfer_kv_generation_tokens_total") == 4
    assert mid.get("ninfer_kv_prefix_cache_hit_tokens_total") == before.get("ninfer_kv_prefix_cache_hit_tokens_total")
    assert (mid.get("ninfer_kv_requests_total", finish_reason="length")
            - before.get("ninfer_kv_requests_total", finish_reason="length")) == 1

    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert cached_tokens(second.usage) == n - 1 and second.choices[0].text == first.choices[0].text
    after = wait_idle(http)
    hits = after.get("ninfer_kv_prefix_cache_hit_tokens_total") - mid.get("ninfer_kv_prefix_cache_hit_tokens_total")
    assert hits == n - 1
    assert after.value("ninfer_kv_pages_used", pool="main") > 0, "the cached prefix holds pages"

    # /reset_prefix_cache releases every cached prefix: nothing is held, the prompt is computed again
    assert http.post("/reset_prefix_cache").status_code == 200
    assert scrape(http).value("ninfer_kv_pages_used", pool="main") == 0
    third = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert cached_tokens(third.usage) == 0 and third.choices[0].text == first.choices[0].text


def test_metrics_expose_every_series(client, http):
    client.completions.create(model=MODEL, prompt="Metrics after a request", max_tokens=3, temperature=0)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = wait_idle(http)
    for name in ("ninfer_kv_requests_running", "ninfer_kv_requests_waiting", "ninfer_kv_host_tier_bytes",
                 "ninfer_kv_prefix_cache_hit_tokens_total", "ninfer_kv_prompt_tokens_total",
                 "ninfer_kv_generation_tokens_total"):
        assert m.find(name), f"{name} is missing from /metrics:\n{m.text}"
    assert m.value("ninfer_kv_pages_capacity", pool="main") == KV_CAPACITY // PAGE_TOKENS
    assert 0 <= m.value("ninfer_kv_pages_used", pool="main") <= KV_CAPACITY // PAGE_TOKENS
    assert m.value("ninfer_kv_host_tier_bytes") == 0, "no --host-memory: no host tier"
    for name in ("ninfer_kv_time_to_first_token_seconds", "ninfer_kv_inter_token_latency_seconds"):
        assert m.types.get(name) == "histogram", f"{name} is not a histogram: {m.types.get(name)}"
        assert m.get(name + "_count") >= 1 and m.find(name + "_bucket", le="+Inf")
    assert m.get("ninfer_kv_requests_total", finish_reason="length") >= 1
    assert all(lab["finish_reason"] in ("stop", "length", "abort") for lab, _ in m.find("ninfer_kv_requests_total"))
    assert m.get("ninfer_kv_generation_tokens_total") >= 3
