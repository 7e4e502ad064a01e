"""EngineCore's policies, each against the same request served alone (PagedGenerator).

Token-granular prefix reuse (a finished request, requests arriving together, a second chat turn),
admission by entitlement (a request that does not fit waits, nothing overtakes it, nothing is
preempted), eviction with and without a Host tier, ``n > 1``, aborts, refused requests, a model
step that raises, log-probabilities, stop token ids and EOS.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from ninfer_kv.engine import SamplingParams
from ninfer_kv.engine.core import MIN_SHARED_TOKENS
from ninfer_kv.schema.errors import DonatedStateError
from ninfer_kv.models.decoder.sampling import SamplingConfig
from store.helpers import assert_same

from .engine_fixtures import (
    MAX_MODEL_LEN,
    VOCAB,
    assert_store_empty,
    check_engine,
    decoder_model,
    drain,
    make_llm,
    reference,
)

SMALL = 6 * 64
"""A Main pool of 6 pages: one request of 200 + 8 tokens (4 pages) at a time, with room for 2 more pages."""


def tokens(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_alone(out, max_tokens: int) -> None:
    """Every completion of ``out`` equals the request served alone (greedy, ``max_tokens``)."""
    want = reference().greedy(out.prompt_token_ids, max_tokens)
    for c in out.outputs:
        assert c.token_ids == want, (out.request_id, c.index, c.token_ids, want)
        assert c.finish_reason == "length"


def run_one(engine, rid, prompt, params):
    """Serve one request to its end (after whatever else is queued); its output."""
    engine.add_request(rid, prompt, params)
    out = drain(engine)[rid]
    check_engine(engine)
    return out


# -- prefix reuse at token granularity ----------------------------------------------------------------
def test_second_request_reuses_exactly_the_shared_tokens():
    rng = np.random.default_rng(1)
    engine = make_llm().engine
    first = tokens(rng, 170)
    out1 = run_one(engine, "a", first, greedy(4))
    assert out1.num_cached_tokens == 0
    assert_alone(out1, 4)
    second = first[:150] + [(first[150] + 1) % VOCAB] + tokens(rng, 20)  # 150 shared tokens, not page aligned
    out2 = run_one(engine, "b", second, greedy(6))
    assert out2.num_cached_tokens == 150 and 150 % 64 != 0
    assert_alone(out2, 6)
    # a prompt the cache holds whole: all but its last token are reused (that one is computed to sample from)
    third = first[:101]
    out3 = run_one(engine, "c", third, greedy(3))
    assert out3.num_cached_tokens == 100
    assert_alone(out3, 3)
    # the first request's generated tokens are cached too (all but the last, never fed back)
    fourth = first + out1.outputs[0].token_ids + tokens(rng, 5)
    out4 = run_one(engine, "d", fourth, greedy(5))
    assert out4.num_cached_tokens == len(first) + 3
    assert_alone(out4, 5)
    assert engine.cache.stats.hits == 3 and engine.stats.prefix_jobs == 0
    assert_store_empty(engine)


def test_requests_arriving_together_share_one_prefix_job():
    rng = np.random.default_rng(2)
    engine = make_llm().engine
    system = tokens(rng, 150)
    prompts = [system + tokens(rng, int(k)) for k in (5, 30, 12, 1, 40, 9)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(5))
    check_engine(engine)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        check_engine(engine)
    assert engine.stats.prefix_jobs == 1
    for i in range(len(prompts)):
        assert done[f"r{i}"].num_cached_tokens == 150
        assert_alone(done[f"r{i}"], 5)
    # the system prompt was prefilled once: 150 tokens, then only each request's own suffix
    assert engine.stats.prefill_tokens == 150 + sum(len(p) - 150 for p in prompts)
    assert_store_empty(engine)


def test_requests_sharing_less_than_a_page_beyond_the_cache_run_no_job():
    rng = np.random.default_rng(3)
    engine = make_llm().engine
    stem = tokens(rng, MIN_SHARED_TOKENS - 1)
    for i in range(3):
        engine.add_request(f"r{i}", stem + tokens(rng, 20), greedy(3))
    done = drain(engine)
    assert engine.stats.prefix_jobs == 0
    for out in done.values():
        assert out.num_cached_tokens == 0
        assert_alone(out, 3)


def test_second_chat_turn_reuses_the_whole_first_turn():
    rng = np.random.default_rng(4)
    engine = make_llm().engine
    turn1 = tokens(rng, 97)
    out1 = run_one(engine, "t1", turn1, greedy(8))
    answer = out1.outputs[0].token_ids
    turn2 = turn1 + answer + tokens(rng, 11)
    out2 = run_one(engine, "t2", turn2, greedy(8))
    assert out2.num_cached_tokens == len(turn1) + len(answer) - 1
    assert_alone(out2, 8)
    turn3 = turn2 + out2.outputs[0].token_ids + tokens(rng, 3)
    out3 = run_one(engine, "t3", turn3, greedy(8))
    assert out3.num_cached_tokens == len(turn2) + 8 - 1
    assert_alone(out3, 8)
    assert len(engine.cache) == 1  # each turn's entry replaced the one it extends
    assert_store_empty(engine)


def test_waiting_prompts_that_extend_one_another():
    """Queued prompts that are prefixes of one another (chat turns, retries) are indexed by their own
    tokens, whichever arrives first and whichever leaves first."""
    rng = np.random.default_rng(19)
    engine = make_llm().engine
    stem = tokens(rng, 100)
    long_ = stem + tokens(rng, 60)
    prompts = {"long": long_, "stem": stem, "mid": long_[:130], "longer": long_ + tokens(rng, 20), "one": stem[:1]}
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(3))
        check_engine(engine)
    engine.abort("long")  # the prompt the others were indexed under leaves first
    engine.abort("longer")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        check_engine(engine)
    assert done["long"].outputs[0].finish_reason == done["longer"].outputs[0].finish_reason == "abort"
    for rid in ("stem", "mid", "one"):
        assert_alone(done[rid], 3)
    assert done["mid"].num_cached_tokens <= 129 and done["stem"].num_cached_tokens <= 99
    assert_store_empty(engine)
    # the same through LLM.generate: a prompt and its extension in one call
    llm = make_llm()
    outs = llm.generate([stem, stem + [5], stem[:50]], greedy(4))
    for o in outs:
        assert_alone(o, 4)


# -- admission by entitlement -------------------------------------------------------------------------------
def test_a_request_that_does_not_fit_waits_and_nothing_overtakes_it():
    rng = np.random.default_rng(5)
    engine = make_llm(kv_capacity=SMALL).engine
    big_a, big_b, small = tokens(rng, 200), tokens(rng, 200), tokens(rng, 10)
    engine.add_request("a", big_a, greedy(8))  # 208 tokens: 4 of the 6 pages
    engine.add_request("b", big_b, greedy(8))  # 4 more pages: waits for "a"
    engine.add_request("c", small, greedy(8))  # 1 page would fit, but "b" is first
    done, rounds_a_ran = {}, 0
    while "a" not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
        check_engine(engine)
        rounds_a_ran += 1
        if "a" not in done:
            assert [r.request_id for r in engine.waiting] == ["b", "c"]
            assert len(engine.running) == 1 and engine.running[0].request.request_id == "a"
            occ = engine.store.occupancy()
            assert occ.allocated + occ.reserved == 4
    assert rounds_a_ran == 8  # never preempted: one ragged round of its 200 prompt tokens, then one decode per round
    done.update(drain(engine))
    for rid, p in (("a", big_a), ("b", big_b), ("c", small)):
        assert done[rid].prompt_token_ids == p
        assert_alone(done[rid], 8)
    assert engine.cache.stats.released >= 1  # "a"'s entry made room for "b"
    assert_store_empty(engine)


def test_a_request_that_can_never_fit_is_refused_not_queued_forever():
    rng = np.random.default_rng(6)
    engine = make_llm(kv_capacity=4 * 64, max_num_seqs=4).engine  # one row's worth of pages
    before = engine.store.snapshot()
    with pytest.raises(ValueError, match="n=5"):
        engine.add_request("too-many-rows", tokens(rng, 20), greedy(4, n=5))
    with pytest.raises(ValueError, match="pages"):
        engine.add_request("too-many-pages", tokens(rng, 200), greedy(8, n=2))  # 2 x 4 pages, or 4 + 2 x 1 shared
    assert_same(before, engine.store.snapshot())
    assert not engine.has_unfinished()
    out = run_one(engine, "fits", tokens(rng, 100), greedy(8, n=2))  # 2 pages shared + 2 x 1 tail pages
    assert out.num_cached_tokens == 99
    assert_alone(out, 8)


def test_a_fork_that_cannot_fit_beside_its_source_starts_from_the_root():
    """The entry a request would fork is the one thing in the way: the request starts without it."""
    rng = np.random.default_rng(7)
    engine = make_llm(kv_capacity=4 * 64, max_num_seqs=4).engine
    first = tokens(rng, 250)
    run_one(engine, "a", first, greedy(1))  # a 250-token entry: all 4 pages
    second = first[:100] + tokens(rng, 150)  # shares 100 tokens; 250 + 6 tokens need 4 pages of their own
    out = run_one(engine, "b", second, greedy(6))
    assert out.num_cached_tokens == 0
    assert_alone(out, 6)
    assert_store_empty(engine)


# -- eviction -----------------------------------------------------------------------------------------------
def test_eviction_releases_least_recently_used_entries_without_a_host_tier():
    rng = np.random.default_rng(8)
    engine = make_llm(kv_capacity=SMALL).engine
    prompts = [tokens(rng, 130) for _ in range(4)]  # 138 tokens each: 3 pages
    outs = [run_one(engine, f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    for o in outs:
        assert_alone(o, 8)
    assert engine.cache.stats.released >= 2 and engine.cache.stats.offloaded == 0
    assert engine.store.occupancy().allocated <= 6
    # the oldest prompt was released: asked again, it is computed again and still right
    again = run_one(engine, "again", prompts[0], greedy(8))
    assert again.num_cached_tokens == 0
    assert_alone(again, 8)
    # the newest is still cached
    last = run_one(engine, "last", prompts[-1] + outs[-1].outputs[0].token_ids + [1, 2], greedy(3))
    assert last.num_cached_tokens == 130 + 7
    assert_alone(last, 3)
    assert_store_empty(engine)


def test_eviction_offloads_to_the_host_tier_and_a_later_hit_restores():
    rng = np.random.default_rng(9)
    engine = make_llm(kv_capacity=SMALL, host_memory="4MiB").engine
    prompts = [tokens(rng, 130) for _ in range(4)]
    outs = [run_one(engine, f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    for o in outs:
        assert_alone(o, 8)
    stats = engine.cache.stats
    assert stats.offloaded >= 2 and stats.released == 0 and len(engine.cache) == 4
    entry, m = engine.cache.match(prompts[0] + outs[0].outputs[0].token_ids, 10**6)
    assert m == 137 and engine.store.checkpoint(entry.value).placement == "host"
    restored_before = engine.store.memory_summary().restored_pages
    follow = prompts[0] + outs[0].outputs[0].token_ids + tokens(rng, 4)
    out = run_one(engine, "hit", follow, greedy(8))
    assert out.num_cached_tokens == 137
    assert engine.store.memory_summary().restored_pages > restored_before
    assert_alone(out, 8)
    assert_store_empty(engine)


def test_an_entry_sharing_pages_with_a_running_sequence_is_released_not_offloaded():
    """Eviction meets an entry whose first page a just-started fork reads: that page must stay on
    Device, so the entry cannot be offloaded; it is released instead and the admission goes on."""
    rng = np.random.default_rng(20)
    engine = make_llm(kv_capacity=4 * 64, max_num_seqs=4, host_memory="4MiB").engine
    prompt = tokens(rng, 68)
    out = run_one(engine, "first", prompt, greedy(7, n=2))  # the job's 67 tokens + a 74-token completion
    assert_alone(out, 7)
    assert sorted(e.length for e in engine.cache.index) == [67, 74]
    out = run_one(engine, "again", prompt, greedy(3, n=2))  # two forks: the second needs the 67-token entry's page
    assert_alone(out, 3)
    assert engine.cache.stats.released >= 1
    assert_store_empty(engine)


def test_pages_a_hit_restored_from_the_host_tier_can_be_evicted_again():
    """A hit on a Host-only entry restores the pages it forks; that entry then reads as placed on the
    Host (some pages Host-only) but holds Device pages, which a later admission must be able to free."""
    rng = np.random.default_rng(21)
    engine = make_llm(kv_capacity=4 * 64, max_num_seqs=4, host_memory="4MiB").engine
    p, q, r = tokens(rng, 130), tokens(rng, 200), tokens(rng, 200)
    assert_alone(run_one(engine, "p", p, greedy(8)), 8)  # a 137-token entry, 3 pages
    assert_alone(run_one(engine, "q", q, greedy(8)), 8)  # needs the whole pool: p's entry goes to the Host
    out = run_one(engine, "hit", p[:100] + tokens(rng, 20), greedy(4))  # restores p's first 2 pages
    assert out.num_cached_tokens == 100
    assert_alone(out, 4)
    entry, _ = engine.cache.match(p, 10**6)
    info = engine.store.checkpoint(entry.value)
    assert info.placement == "host" and info.page_placement["both"] > 0
    out = run_one(engine, "r", r, greedy(8))  # the whole pool again: the restored pages must go
    assert_alone(out, 8)
    assert_store_empty(engine)


# -- n > 1 ----------------------------------------------------------------------------------------------------
def test_greedy_n_completions_are_equal_and_fork_one_prefix_job():
    rng = np.random.default_rng(10)
    engine = make_llm().engine
    prompt = tokens(rng, 90)
    out = run_one(engine, "n3", prompt, greedy(6, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert_alone(out, 6)
    assert engine.stats.prefix_jobs == 1
    assert engine.stats.prefill_tokens == 89 + 3  # the job prefilled 89 tokens once, each fork its last one
    assert out.num_cached_tokens == 89
    assert_store_empty(engine)


def test_sampled_completions_are_reproducible_distinct_and_batch_independent():
    rng = np.random.default_rng(11)
    engine = make_llm().engine
    prompt = tokens(rng, 70)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, n=2)
    first = run_one(engine, "s1", prompt, params)
    a, b = (c.token_ids for c in first.outputs)
    assert a != b
    # again: now a cache hit and batched with other requests; the same tokens
    engine.add_request("s2", prompt, params)
    engine.add_request("other", tokens(rng, 40), greedy(8))
    second = drain(engine)["s2"]
    assert [c.token_ids for c in second.outputs] == [a, b]
    assert second.num_cached_tokens == 69
    # completion i is seeded with seed + i, as served alone
    m = decoder_model()
    from ninfer_kv.models.generate import PagedGenerator

    gen = PagedGenerator(m.params, m.config, max_context=MAX_MODEL_LEN, max_batch=1)
    for i, want in enumerate((a, b)):
        alone = gen.generate([prompt], max_new_tokens=8, sampling=SamplingConfig(temperature=1.0, seed=1234 + i))
        assert alone[0].generated == want
    other_seed = run_one(engine, "s3", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=99, n=2))
    assert [c.token_ids for c in other_seed.outputs] != [a, b]
    # top-k and top-p too, as served alone
    nucleus = SamplingParams(max_tokens=8, temperature=0.9, top_k=5, top_p=0.8, seed=7)
    got = run_one(engine, "s4", prompt, nucleus).outputs[0].token_ids
    config = SamplingConfig(temperature=0.9, top_k=5, top_p=0.8, seed=7)
    alone = gen.generate([prompt], max_new_tokens=8, sampling=config)
    assert alone[0].generated == got
    assert_store_empty(engine)


def test_requests_without_a_seed_draw_theirs_from_the_engine_seed():
    rng = np.random.default_rng(24)
    ps = [tokens(rng, 40), tokens(rng, 30)]
    params = SamplingParams(max_tokens=6, temperature=1.0, n=2)

    def sample(seed):
        llm = make_llm(seed=seed)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params)]

    first = sample(7)
    assert first == sample(7)
    assert first != sample(8)
    assert first[0][0] != first[0][1]


def test_max_tokens_none_generates_up_to_the_context():
    rng = np.random.default_rng(25)
    engine = make_llm().engine
    prompt = tokens(rng, MAX_MODEL_LEN - 6)
    out = run_one(engine, "full", prompt, SamplingParams(max_tokens=None, temperature=0.0))
    assert out.outputs[0].token_ids == reference().greedy(prompt, 6) and out.outputs[0].finish_reason == "length"
    # max_tokens beyond the context is clipped to it as well
    out = run_one(engine, "clipped", prompt[:-2], greedy(1000 - 1))
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == reference().greedy(prompt[:-2], 8)
    assert_store_empty(engine)


# -- aborts --------------------------------------------------------------------------------------------------
def test_abort_of_a_waiting_and_of_a_running_request():
    rng = np.random.default_rng(12)
    engine = make_llm(kv_capacity=SMALL, max_num_batched_tokens=128).engine
    pa, pb = tokens(rng, 200), tokens(rng, 150)
    engine.add_request("a", pa, greedy(8))
    engine.add_request("b", pb, greedy(8))
    for _ in range(4):  # "a": two prefill chunks, then 2 decodes; "b" waits for pages
        assert not [o for o in engine.step() if o.finished]
    assert [r.request_id for r in engine.waiting] == ["b"]
    assert engine.abort("b") and not engine.abort("b") and not engine.abort("nope")
    assert engine.abort("a")
    outs = {o.request_id: o for o in engine.step()}
    check_engine(engine)
    b = outs["b"]
    assert b.finished and b.outputs[0].finish_reason == "abort" and b.outputs[0].token_ids == []
    a = outs["a"]
    assert a.finished and a.outputs[0].finish_reason == "abort"
    got = a.outputs[0].token_ids
    assert len(got) == 3 and got == reference().greedy(pa, 3)
    # the rows are free, nothing waits, and the committed prefix of "a" is cached
    assert engine.running == [] and engine.waiting == [] and engine.store.occupancy().active_spaces == 0
    assert not engine.has_unfinished()
    entry, m = engine.cache.match(pa + got + [0], 10**6)
    assert m == len(pa) + len(got) - 1
    follow = pa + got + tokens(rng, 3)
    out = run_one(engine, "follow", follow, greedy(5))
    assert out.num_cached_tokens == len(pa) + len(got) - 1
    assert_alone(out, 5)
    # an id is free again once its request finished
    out = run_one(engine, "a", pa, greedy(2))
    assert_alone(out, 2)
    assert_store_empty(engine)


def test_abort_during_a_prefix_job_and_of_an_n2_request():
    rng = np.random.default_rng(13)
    engine = make_llm(max_num_batched_tokens=128).engine  # the jobs take two rounds
    system = tokens(rng, 200)
    engine.add_request("x", system + tokens(rng, 5), greedy(4))
    engine.add_request("y", system + tokens(rng, 7), greedy(4))
    engine.add_request("n2", tokens(rng, 60), greedy(4, n=2))
    engine.step()  # the jobs run (the shared system prompt, the n=2 prompt)
    assert engine.jobs
    engine.abort("x")
    engine.abort("n2")
    done = drain(engine)
    check_engine(engine)
    assert done["x"].outputs[0].finish_reason == "abort"
    assert [c.finish_reason for c in done["n2"].outputs] == ["abort", "abort"]
    assert_alone(done["y"], 4)
    assert_store_empty(engine)


def test_without_prefix_caching_nothing_is_kept_and_n2_forks_a_private_prefix():
    rng = np.random.default_rng(22)
    engine = make_llm(enable_prefix_caching=False, max_num_batched_tokens=128).engine
    prompt = tokens(rng, 80)
    out = run_one(engine, "n2", prompt, greedy(5, n=2))
    assert_alone(out, 5)
    assert engine.stats.prefix_jobs == 1 and out.num_cached_tokens == 0  # computed for this request alone
    assert len(engine.cache) == 0 and engine.store.occupancy().retained_checkpoints == 0
    again = run_one(engine, "again", prompt, greedy(5))
    assert again.num_cached_tokens == 0
    assert_alone(again, 5)
    # aborted while its private prefix is computed: the checkpoint is released when the job ends
    engine.add_request("gone", tokens(rng, 200), greedy(5, n=2))
    engine.add_request("stays", prompt + [1], greedy(3, n=2))
    engine.step()
    assert engine.jobs
    engine.abort("gone")
    done = drain(engine)
    check_engine(engine)
    assert [c.finish_reason for c in done["gone"].outputs] == ["abort", "abort"]
    assert_alone(done["stays"], 3)
    assert engine.store.occupancy().retained_checkpoints == 0 and len(engine.cache) == 0
    assert_store_empty(engine)


@pytest.mark.parametrize("caching", [True, False], ids=["shared-job", "private-job"])
def test_a_failing_prefix_job_leaves_its_requests_to_prefill_themselves(caching):
    rng = np.random.default_rng(23)
    engine = make_llm(model=FailingModel(decoder_model(), fail_on={1}, kind="prefill"),
                      enable_prefix_caching=caching).engine
    system = tokens(rng, 150)
    prompts = {"x": system + tokens(rng, 5), "y": system + tokens(rng, 9)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(4, n=1 if caching else 2))
    outs = engine.step()  # the job's (only) prefill raises: no request was in that step
    assert engine.stats.failed_steps == 1 and not [o for o in outs if o.finished]
    check_engine(engine)
    done = drain(engine)
    check_engine(engine)
    for rid, p in prompts.items():
        assert done[rid].error is None
        assert_alone(done[rid], 4)
    assert_store_empty(engine)


# -- refused requests -------------------------------------------------------------------------------------------
def test_bad_requests_are_refused_and_change_nothing():
    rng = np.random.default_rng(14)
    engine = make_llm(kv_capacity=SMALL).engine
    engine.add_request("run", tokens(rng, 200), greedy(8))
    engine.step()
    engine.add_request("wait", tokens(rng, 200), greedy(8))
    engine.step()
    assert [r.request_id for r in engine.waiting] == ["wait"]
    good = tokens(rng, 10)
    bad = [
        (ValueError, "long", tokens(rng, MAX_MODEL_LEN), None),
        (ValueError, "empty", [], None),
        (ValueError, "oov", good + [VOCAB], None),
        (ValueError, "negative", [-1] + good, None),
        (TypeError, "float", good + [3.0], None),
        (TypeError, "bool", [True] + good, None),
        (TypeError, "np-float", [np.float32(2)] + good, None),
        (TypeError, "text", "hello", None),
        (TypeError, "params", good, {"max_tokens": 3}),
        (ValueError, "stop-id", good, SamplingParams(stop_token_ids=[VOCAB])),
        (ValueError, "run", good, None),  # a duplicate of an unfinished request
        (ValueError, "wait", good, None),
        (TypeError, "", good, None),
        (TypeError, 7, good, None),
        (ValueError, "n-rows", good, SamplingParams(n=5)),
    ]
    for exc, rid, prompt, params in bad:
        snap = engine.store.snapshot()
        waiting = [r.request_id for r in engine.waiting]
        requests = dict(engine.requests)
        with pytest.raises(exc):
            engine.add_request(rid, prompt, params)
        assert_same(snap, engine.store.snapshot())
        assert [r.request_id for r in engine.waiting] == waiting and engine.requests == requests
        check_engine(engine)
    for kw in (dict(temperature=-1.0), dict(top_p=0.0), dict(max_tokens=0), dict(max_tokens=1.5), dict(n=0),
               dict(logprobs=21), dict(seed=-1), dict(top_k=-2), dict(temperature=float("nan"))):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**kw)
    done = drain(engine)
    assert_alone(done["run"], 8)
    assert_alone(done["wait"], 8)
    # LLM.generate checks every prompt before queueing any
    llm = make_llm(kv_capacity=SMALL)
    snap = llm.engine.store.snapshot()
    with pytest.raises(ValueError):
        llm.generate([good, good + [1], good + [VOCAB]], greedy(2))
    with pytest.raises(ValueError):
        llm.generate([good, good], [greedy(2)])
    assert_same(snap, llm.engine.store.snapshot())
    assert not llm.engine.has_unfinished() and llm.engine.stats.prefill_units == 0


# -- a model step that raises -------------------------------------------------------------------------------------
class FailingModel:
    """A DecoderModel whose ``kind`` step raises on the given calls (``consume``: after running, so the
    state it was given is gone)."""

    def __init__(self, inner, fail_on, kind="decode", consume=False):
        self.inner, self.fail_on, self.kind, self.consume = inner, set(fail_on), kind, consume
        self.vocab_size, self.prefill_chunk = inner.vocab_size, inner.prefill_chunk
        self.calls = 0

    def kv_config(self, profile):
        return self.inner.kv_config(profile)

    def prepare(self, profile, buckets):
        self.inner.prepare(profile, buckets)

    def _step(self, kind, state, work, *args):
        run = getattr(self.inner, kind)
        if kind == self.kind:
            self.calls += 1
            if self.calls in self.fail_on:
                if self.consume:  # the step ran with the state donated, then failed
                    run(state, work, *args)
                    try:  # donation is up to the runtime: make sure the state is gone
                        leaves = jax.tree_util.tree_leaves(state)
                    except DonatedStateError:
                        leaves = []
                    for leaf in leaves:
                        leaf.delete()
                raise RuntimeError(f"injected failure of {kind} call {self.calls}")
        return run(state, work, *args)

    def prefill(self, state, work, *args):
        return self._step("prefill", state, work, *args)

    def decode(self, state, work, *args):
        return self._step("decode", state, work, *args)


@pytest.mark.parametrize("consume", [False, True], ids=["state-kept", "state-consumed"])
def test_a_failing_step_fails_only_its_requests_and_the_engine_keeps_serving(consume):
    rng = np.random.default_rng(15)
    model = FailingModel(decoder_model(), fail_on={2}, consume=consume)
    engine = make_llm(model=model).engine
    cached = tokens(rng, 80)
    run_one(engine, "cached", cached, greedy(2))  # decode call 1; its entry is in the cache
    pa, pb, pc = tokens(rng, 30), tokens(rng, 40), tokens(rng, 200)
    engine.add_request("a", pa, greedy(6))
    engine.add_request("b", pb, greedy(6))
    engine.step()  # a, b prefill and produce their first token
    engine.add_request("c", pc, greedy(6))  # two prefill chunks
    outs = {o.request_id: o for o in engine.step()}  # c's first chunk; a and b decode: call 2 raises
    check_engine(engine)
    assert engine.stats.failed_steps == 1
    for rid in ("a", "b"):
        o = outs[rid]
        assert o.finished and o.error is not None and "injected failure" in o.error
        assert o.outputs[0].finish_reason == "abort" and len(o.outputs[0].token_ids) == 1
    if consume:  # a fresh state holds nothing: c's prefilled chunk is lost, and so is the cache
        assert outs["c"].finished and "lost" in outs["c"].error and len(engine.cache) == 0
        assert outs["c"].outputs[0].finish_reason == "abort"
    else:  # c's chunk ran in its own step, before the failing one: c completes
        done = drain(engine)
        assert done["c"].error is None
        assert_alone(done["c"], 6)
    check_engine(engine)
    # the engine keeps serving, correctly, from the cache where it survived
    out = run_one(engine, "d", cached + [7, 8, 9], greedy(6))
    assert out.num_cached_tokens == (0 if consume else 80)
    assert_alone(out, 6)
    out = run_one(engine, "e", pa, greedy(6))
    assert_alone(out, 6)
    assert_store_empty(engine)


def test_llm_generate_raises_request_failed_with_every_output():
    from ninfer_kv.engine import RequestFailedError

    rng = np.random.default_rng(16)
    llm = make_llm(model=FailingModel(decoder_model(), fail_on={1}, kind="prefill"))
    p1 = tokens(rng, 20)
    with pytest.raises(RequestFailedError) as info:
        llm.generate([p1, tokens(rng, 30)], greedy(3))
    assert info.value.request_ids == ["0", "1"] and len(info.value.outputs) == 2
    out = llm.generate(p1, greedy(3))[0]
    assert_alone(out, 3)


# -- log-probabilities, stop ids, EOS ------------------------------------------------------------------------------
def log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max()
    return z - math.log(np.exp(z).sum())


def test_logprobs_equal_log_softmax_of_the_reference_logits():
    rng = np.random.default_rng(17)
    engine = make_llm().engine
    prompt = tokens(rng, 75)
    out = run_one(engine, "lp", prompt, greedy(5, logprobs=2))
    c = out.outputs[0]
    want_tokens = reference().greedy(prompt, 5)
    assert c.token_ids == want_tokens and len(c.logprobs) == 5
    total = 0.0
    for tok, entry, logits in zip(c.token_ids, c.logprobs, reference().logits(prompt, 5)):
        lp = log_softmax(logits)
        top2 = [int(t) for t in np.argsort(-lp, kind="stable")[:2]]
        assert tok == top2[0] and set(entry) == set(top2)  # greedy: the chosen one is the top alternative
        for rank, t in enumerate(top2, start=1):
            assert entry[t].rank == rank
            assert abs(entry[t].logprob - lp[t]) < 1e-4
            assert entry[t].decoded_token is None  # no tokenizer
        total += lp[tok]
    assert abs(c.cumulative_logprob - total) < 1e-3
    # sampled: the chosen token is always there, with its rank among all tokens
    out = run_one(engine, "lp2", prompt, SamplingParams(max_tokens=6, temperature=1.5, seed=5, logprobs=0))
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert list(entry) == [tok] and entry[tok].rank >= 1 and entry[tok].logprob <= 0
    # without logprobs none are computed
    plain = run_one(engine, "plain", prompt, greedy(2))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_stop_token_ids_eos_and_ignore_eos():
    rng = np.random.default_rng(18)
    prompt = tokens(rng, 50)
    want = reference().greedy(prompt, 8)
    k = next(i for i in range(2, 8) if want[i] not in want[:i])
    stop = want[k]
    engine = make_llm().engine
    out = run_one(engine, "stop", prompt, greedy(8, stop_token_ids=[stop]))
    c = out.outputs[0]
    assert c.token_ids == want[: k + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    eos_engine = make_llm(eos_token_ids=[stop]).engine
    out = run_one(eos_engine, "eos", prompt, greedy(8))
    c = out.outputs[0]
    assert c.token_ids == want[: k + 1] and c.finish_reason == "stop" and c.stop_reason is None
    out = run_one(eos_engine, "ignore", prompt, greedy(8, ignore_eos=True))
    assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "length"
    # a stop id given with ignore_eos still stops
    out = run_one(eos_engine, "both", prompt, greedy(8, ignore_eos=True, stop_token_ids=[stop]))
    assert out.outputs[0].token_ids == want[: k + 1] and out.outputs[0].stop_reason == stop


def test_lease_growth_runs_more_requests_and_ends_the_one_the_pool_cannot_extend_at_length():
    """Six pages; two requests of 10 prompt tokens and no max_tokens (each may reach the 256-token
    context: 4 pages).  Without growth the second waits for the first; with it both start (the second
    leases the 2 pages left), and the second ends with "length" once the pool cannot extend it,
    its tokens a prefix of the first's (same prompt, greedy)."""
    rng = np.random.default_rng(11)
    prompt = tokens(rng, 10)
    for growth in (False, True):
        engine = make_llm(kv_capacity=SMALL, lease_growth=growth, enable_prefix_caching=False).engine
        engine.add_request("first", prompt, greedy(None))
        engine.add_request("second", prompt, greedy(None))
        engine.step()
        assert len(engine.running) == (2 if growth else 1)
        done = drain(engine)
        check_engine(engine)
        first, second = done["first"].outputs[0], done["second"].outputs[0]
        assert first.finish_reason == second.finish_reason == "length"
        assert len(first.token_ids) == MAX_MODEL_LEN - len(prompt)
        if growth:
            assert 64 <= len(second.token_ids) < len(first.token_ids)  # bounded completion at its covered frontier
            assert second.token_ids == first.token_ids[: len(second.token_ids)]
        else:
            assert second.token_ids == first.token_ids
        assert_store_empty(engine)
