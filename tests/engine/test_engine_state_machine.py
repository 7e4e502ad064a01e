"""EngineCore as a stateful model check: submit, step, abort, run to completion and clear the cache in
any order, over a store small enough that admissions wait and cached prefixes are evicted.

Prompts share prefixes the way served traffic does: a few random stems of 30-200 tokens cut at a
random point and extended, exact repeats, and later turns of a conversation (an earlier prompt plus
its output plus new tokens).  Requests are greedy with ``max_tokens`` 1-8 and ``n`` 1 or 2; the
engine runs with or without a Host tier and with 2 or 4 rows.

After every rule: the store's invariants, every running sequence on a leased row, no more rows in
use than ``max_num_seqs``, the prefix indexes consistent.  Every finished request's tokens equal the
same request served alone (an aborted one's are a prefix of them) and ``num_cached_tokens`` is at
most ``prompt - 1``.  After everything finished and ``clear_cache()`` the store holds nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ninfer_kv.engine import SamplingParams
from ninfer_kv.schema.geometry import PAGE_SIZE

from .engine_fixtures import MAX_MODEL_LEN, MAX_TOKENS, VOCAB, assert_store_empty, check_engine, make_llm, reference

MAX_PROMPT = MAX_MODEL_LEN - 2 * MAX_TOKENS
"""Longest prompt the machine submits (a conversation stops growing there)."""

CONFIGS = {
    # 6 pages: one long request (4 pages) beside a short one; every n=2 request fits an idle pool
    "rows4": dict(max_num_seqs=4, kv_capacity=6 * PAGE_SIZE),
    "rows4-host": dict(max_num_seqs=4, kv_capacity=6 * PAGE_SIZE, host_memory="4MiB"),
    # 4 pages, 2 rows: one long request at a time; some n=2 requests can never fit and are refused
    "rows2-host": dict(max_num_seqs=2, kv_capacity=4 * PAGE_SIZE, host_memory="4MiB"),
}


def pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def fits_idle_pool(prompt: int, max_tokens: int, n: int, capacity_pages: int) -> bool:
    """Whether an idle engine can start the request: each completion's whole reservation, or the
    prompt's checkpoint and ``n`` forks sharing its full pages."""
    whole = pages(prompt + max_tokens)
    need = n * whole
    if n > 1:
        need = min(need, pages(prompt - 1) + n * (whole - (prompt - 1) // PAGE_SIZE))
    return need <= capacity_pages


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = None
        self.requests: dict[str, dict] = {}  # request id -> prompt, max_tokens, n, aborted
        self.unfinished: set[str] = set()
        self.finished: list[tuple[list[int], list[int]]] = []  # (prompt, greedy output) of completed requests
        self.ids = 0

    @initialize(config=st.sampled_from(sorted(CONFIGS)), seed=st.integers(0, 2**32 - 1),
                stem_lengths=st.lists(st.integers(30, 200), min_size=1, max_size=3))
    def start(self, config, seed, stem_lengths):
        self.config = CONFIGS[config]
        self.engine = make_llm(**self.config).engine
        self.capacity = self.engine.store.pool("main").capacity
        self.rng = np.random.default_rng(seed)
        self.stems = [self._random(n) for n in stem_lengths]

    def _random(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, VOCAB, n)]

    # -- rules -------------------------------------------------------------------------------------------
    @rule(data=st.data(), count=st.integers(1, 4))
    def submit(self, data, count):
        """``count`` requests at once (arriving together, as a shared system prompt's do)."""
        for _ in range(count):
            kind = data.draw(st.sampled_from(["stem", "stem", "turn", "repeat"]), label="kind")
            max_tokens = data.draw(st.integers(1, MAX_TOKENS), label="max_tokens")
            n = data.draw(st.sampled_from([1, 1, 2]), label="n")
            self._submit(data, kind, max_tokens, n)

    def _submit(self, data, kind, max_tokens, n):
        prompt = None
        if kind == "turn" and self.finished:
            before, output = data.draw(st.sampled_from(self.finished), label="turn of")
            prompt = before + output + self._random(data.draw(st.integers(1, 20), label="new tokens"))
        elif kind == "repeat" and self.requests:
            prompt = list(self.requests[data.draw(st.sampled_from(sorted(self.requests)), label="repeat of")]["prompt"])
        if prompt is None or len(prompt) > MAX_PROMPT:
            stem = data.draw(st.sampled_from(self.stems), label="stem")
            cut = data.draw(st.integers(1, len(stem)), label="cut")
            prompt = stem[:cut] + self._random(data.draw(st.integers(0, 40), label="extension"))
        rid = f"r{self.ids}"
        self.ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
        if not fits_idle_pool(len(prompt), max_tokens, n, self.capacity):
            snap_waiting = [r.request_id for r in self.engine.waiting]
            with pytest.raises(ValueError, match="pages"):
                self.engine.add_request(rid, prompt, params)
            assert [r.request_id for r in self.engine.waiting] == snap_waiting
            return
        self.engine.add_request(rid, prompt, params)
        self.requests[rid] = dict(prompt=prompt, max_tokens=max_tokens, n=n, aborted=False)
        self.unfinished.add(rid)

    @rule()
    def step(self):
        self._collect(self.engine.step())

    @rule(steps=st.integers(2, 6))
    def steps(self, steps):
        for _ in range(steps):
            self._collect(self.engine.step())

    @precondition(lambda self: self.unfinished)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.unfinished)), label="abort")
        first = not self.requests[rid]["aborted"]
        assert self.engine.abort(rid) == first  # an abort is asked once
        self.requests[rid]["aborted"] = True

    @rule()
    def abort_unknown(self):
        assert not self.engine.abort("no-such-request")

    @rule()
    def run_to_completion(self):
        self._drain()

    @rule()
    def clear_cache(self):
        self._drain()
        assert_store_empty(self.engine)

    # -- checks ------------------------------------------------------------------------------------------
    def _drain(self):
        for _ in range(1000):
            if not self.engine.has_unfinished():
                break
            self._collect(self.engine.step())
            check_engine(self.engine)
        assert not self.engine.has_unfinished(), "the engine stopped making progress"
        assert not self.unfinished, self.unfinished

    def _collect(self, outputs):
        for out in outputs:
            req = self.requests[out.request_id]
            assert out.request_id in self.unfinished, f"{out.request_id} reported after it finished"
            prompt = req["prompt"]
            assert out.prompt_token_ids == prompt and len(out.outputs) == req["n"]
            assert 0 <= out.num_cached_tokens <= len(prompt) - 1
            assert out.error is None
            want = reference().greedy(prompt, req["max_tokens"])
            for c in out.outputs:
                assert c.token_ids == want[: len(c.token_ids)], (out.request_id, c.token_ids, want)
                if out.finished:
                    if req["aborted"]:
                        assert c.finish_reason in ("abort", "length")
                    else:
                        assert c.finish_reason == "length"
                    if c.finish_reason == "length":
                        assert c.token_ids == want
                else:
                    assert c.finish_reason is None or c.finish_reason == "length"
            if out.finished:
                self.unfinished.discard(out.request_id)
                if not req["aborted"] and len(prompt) + len(want) <= MAX_PROMPT:
                    self.finished.append((prompt, want))

    @invariant()
    def consistent(self):
        if self.engine is not None:
            check_engine(self.engine)
            assert set(self.engine.requests) == self.unfinished

    def teardown(self):
        if self.engine is not None:
            self._drain()
            assert_store_empty(self.engine)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=10,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
