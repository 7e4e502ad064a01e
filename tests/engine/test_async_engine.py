"""AsyncLLMEngine: concurrent streams, each equal to its request served alone; early exits and
``abort`` free the store; a bad request fails alone; shutdown.

Every test runs its own event loop (``asyncio.run``) over its own engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from ninfer_kv.engine import AsyncLLMEngine, SamplingParams

from .engine_fixtures import VOCAB, assert_store_empty, check_engine, make_llm, reference

TIMEOUT = 120  # seconds a test's event loop may run


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, VOCAB, 90)]
    out = []
    for i in range(count):
        own = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 60)))]
        out.append(system + own if i % 2 else own + system[: i * 5])
    return out


def run(coro, timeout: float = TIMEOUT):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(engine, prompt, params, request_id=None) -> list:
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


def assert_stream(outs: list, prompt, max_tokens: int) -> None:
    """Cumulative outputs, only the last finished, ending with the request served alone."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    for a, b in zip(outs, outs[1:]):
        assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) >= len(a.outputs[0].token_ids)
    last = outs[-1].outputs[0]
    assert last.token_ids == reference().greedy(prompt, max_tokens) and last.finish_reason == "length"
    assert outs[-1].prompt_token_ids == prompt


async def idle(engine: AsyncLLMEngine) -> dict:
    """Wait until the engine has nothing waiting or running; its stats."""
    for _ in range(2000):
        stats = await engine.stats()
        if stats["waiting"] == 0 and stats["running"] == 0 and not engine.engine.has_unfinished():
            return stats
        await asyncio.sleep(0.005)
    raise AssertionError("the engine did not become idle")


def test_concurrent_streams_each_equal_the_request_served_alone():
    llm = make_llm()
    engine = AsyncLLMEngine(llm)
    ps = prompts(1, 12)
    budgets = [3 + i % 6 for i in range(12)]

    async def main():
        return await asyncio.gather(*[collect(engine, p, greedy(k), request_id=f"s{i}")
                                      for i, (p, k) in enumerate(zip(ps, budgets))])

    streams = run(main())
    engine.shutdown()
    for outs, p, k in zip(streams, ps, budgets):
        assert_stream(outs, p, k)
        assert len(outs) >= 2  # tokens arrive as they are produced, not all at the end
    assert llm.engine.stats.rounds > max(budgets)
    check_engine(llm.engine)
    assert_store_empty(llm.engine)


def test_a_consumer_that_leaves_early_aborts_its_request():
    llm = make_llm()
    engine = AsyncLLMEngine(llm)
    ps = prompts(2, 6)

    async def leave_after(p, n, rid):
        seen = []
        async with contextlib.aclosing(engine.generate(p, greedy(8), request_id=rid)) as stream:
            async for out in stream:
                seen.append(out)
                if len(seen) == n:
                    break
        return seen

    async def main():
        results = await asyncio.gather(*[leave_after(p, 2, f"early{i}") if i % 2 == 0 else collect(engine, p, greedy(8))
                                         for i, p in enumerate(ps)])
        # a plain `break` without aclosing: the generator is closed when it is dropped
        async for _ in engine.generate(ps[0] + [1], greedy(8), request_id="dropped"):
            break
        await asyncio.sleep(0)
        return results, await idle(engine)

    results, stats = run(main())
    engine.shutdown()
    for i, (outs, p) in enumerate(zip(results, ps)):
        if i % 2 == 0:
            assert len(outs) == 2 and not outs[-1].finished
            assert outs[-1].outputs[0].token_ids == reference().greedy(p, 8)[: len(outs[-1].outputs[0].token_ids)]
        else:
            assert_stream(outs, p, 8)
    assert stats["running"] == 0 and llm.engine.store.occupancy().active_spaces == 0
    check_engine(llm.engine)
    assert_store_empty(llm.engine)


def test_a_consumer_cancelled_again_while_it_cleans_up_still_aborts_its_request():
    """A server's task group cancels a disconnected stream's task at every await (anyio's cancel
    scopes do): the request is still aborted, promptly, not run to its end."""
    llm = make_llm(max_num_seqs=1)
    engine = AsyncLLMEngine(llm)
    long_prompt = prompts(3, 1)[0]

    async def consume():
        async for _ in engine.generate(long_prompt, greedy(180, ignore_eos=True), request_id="cut"):
            pass  # always waiting inside the stream, where the cancellation lands

    async def main():
        task = asyncio.create_task(consume())
        while (await engine.stats())["running"] == 0:
            await asyncio.sleep(0.01)
        engine._executor.submit(time.sleep, 0.3)  # the engine thread is busy: an abort queues behind it
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # cancelled again inside its cleanup
        with contextlib.suppress(asyncio.CancelledError):
            await task
        stats = await idle(engine)
        return stats

    stats = run(main())
    engine.shutdown()
    assert stats["stats"].decode_tokens < 90, "the request ran (about) to its end: the abort was lost"
    assert_store_empty(llm.engine)


def test_abort_from_another_task_ends_that_stream():
    llm = make_llm()
    engine = AsyncLLMEngine(llm)
    p_abort, p_other = prompts(3, 2)

    async def main():
        first_output = asyncio.Event()
        outs = []

        async def consume():  # a long budget: the abort lands long before it ends
            async for out in engine.generate(p_abort, greedy(200), request_id="victim"):
                outs.append(out)
                first_output.set()
            return outs

        task = asyncio.create_task(consume())
        other = asyncio.create_task(collect(engine, p_other, greedy(8), request_id="bystander"))
        await first_output.wait()
        assert await engine.abort("victim")
        assert not await engine.abort("no-such-request")
        return await task, await other

    outs, other = run(main())
    engine.shutdown()
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    got = last.outputs[0].token_ids
    assert 1 <= len(got) < 200 and got[:8] == reference().greedy(p_abort, min(len(got), 8))
    assert_stream(other, p_other, 8)
    assert_store_empty(llm.engine)


def test_a_bad_request_raises_in_generate_and_the_others_continue():
    llm = make_llm()
    engine = AsyncLLMEngine(llm)
    ps = prompts(4, 3)

    async def bad(prompt, params, rid=None):
        with pytest.raises((ValueError, TypeError)):
            await collect(engine, prompt, params, request_id=rid)

    async def main():
        good = [asyncio.create_task(collect(engine, p, greedy(6), request_id=f"g{i}")) for i, p in enumerate(ps)]
        await asyncio.sleep(0.01)
        await bad([VOCAB], greedy(2))
        await bad([1, 2, 3.5], greedy(2))
        await bad("text without a tokenizer", greedy(2))
        await bad([1, 2], greedy(2, stop_token_ids=[VOCAB]))
        await bad([1, 2], greedy(2, n=99))
        held = engine.generate(ps[0], greedy(None), request_id="held")  # up to the context: still running below
        first = await held.__anext__()
        assert not first.finished
        await bad([1, 2], greedy(2), rid="held")  # a duplicate of a running request
        await held.aclose()  # leaving early aborts it
        return await asyncio.gather(*good)

    streams = run(main())
    for outs, p in zip(streams, ps):
        assert_stream(outs, p, 6)

    async def again():  # the id of a finished request may be used again
        return await collect(engine, ps[0], greedy(2), request_id="g0")

    assert_stream(run(again()), ps[0], 2)
    engine.shutdown()
    assert_store_empty(llm.engine)


def test_a_stream_whose_event_loop_closed_does_not_stall_the_engine():
    """A loop that ends while its stream is unfinished (the consumer left; nobody reads it any more):
    the engine drops the stream, ends the request and keeps serving other loops."""
    llm = make_llm()
    engine = AsyncLLMEngine(llm)
    ps = prompts(6, 2)

    async def leave():  # usually the abort's final output finds the loop closed (the engine is slower)
        async for _ in engine.generate(ps[0], greedy(8), request_id="left"):
            break  # the loop ends right after: the abort's final output finds it closed

    run(leave())
    streams = run(collect(engine, ps[1], greedy(8), request_id="next"), timeout=30)
    assert_stream(streams, ps[1], 8)

    async def settle():
        return await idle(engine)

    run(settle())
    engine.shutdown()
    assert not llm.engine.has_unfinished()
    assert_store_empty(llm.engine)


def test_shutdown_aborts_what_is_unfinished_and_refuses_new_requests():
    llm = make_llm()
    engine = AsyncLLMEngine(llm)
    ps = prompts(5, 3)

    async def main():
        started = [asyncio.Event() for _ in ps]
        results = [[] for _ in ps]

        async def consume(i):
            async for out in engine.generate(ps[i], greedy(8), request_id=f"r{i}"):
                results[i].append(out)
                started[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(len(ps))]
        for e in started:
            await e.wait()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        await asyncio.gather(*tasks)
        with pytest.raises(RuntimeError, match="shut down"):
            await collect(engine, ps[0], greedy(2))
        return results

    results = run(main())
    for outs, p in zip(results, ps):
        last = outs[-1]
        assert last.finished and last.outputs[0].finish_reason in ("abort", "length")
        got = last.outputs[0].token_ids
        assert got == reference().greedy(p, len(got))
    assert not llm.engine.has_unfinished()
    assert_store_empty(llm.engine)
