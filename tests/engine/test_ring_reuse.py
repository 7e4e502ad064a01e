"""The engine over a model with window rings: the same tokens as the model with every layer in the
Main pool, prefix reuse only where the ring snapshot reaches (ninfer_kv.device.ring_snapshots), forks
(n > 1) from snapshots, and every snapshot slot given back."""

import dataclasses

import numpy as np
import pytest

from ninfer_kv.engine import LLM, SamplingParams
from ninfer_kv.engine.model import DecoderModel
from ninfer_kv.models.decoder.config import ModelConfig
from ninfer_kv.models.decoder.weights import init_params

# two windowed layers around a global one; a small window and ring step, so a ring is 3 pages
CONFIG = ModelConfig.tiny(num_layers=3, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                          sliding_window=16, ring_step_tokens=64, dtype="float32")
PARAMS = init_params(CONFIG, seed=3)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _llm(config: ModelConfig, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 2)
    return LLM(DecoderModel(PARAMS, config, prefill_chunk=64), max_model_len=1024, kv_capacity=2048, **kwargs)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    a = rng.integers(0, CONFIG.vocab_size, 260).tolist()
    return {"a": a,
            "resumable": a[:200] + rng.integers(0, CONFIG.vocab_size, 20).tolist(),   # forks a's snapshot at 200
            "too_far": a[:120] + rng.integers(0, CONFIG.vocab_size, 20).tolist()}     # 120: before the snapshot


def test_rings_serve_the_tokens_of_the_model_kept_whole(prompts):
    ringed, whole = _llm(CONFIG), _llm(dataclasses.replace(CONFIG, window_rings=False))
    assert ringed.plan.rings is not None and ringed.plan.rings.spec.pages_per_row == 3
    assert whole.plan.rings is None
    for key in ("a", "resumable"):
        assert ringed.generate([prompts[key]], GREEDY)[0].outputs[0].token_ids == \
            whole.generate([prompts[key]], GREEDY)[0].outputs[0].token_ids


def test_reuse_only_where_the_snapshot_reaches_and_the_same_tokens(prompts):
    cached, uncached = _llm(CONFIG), _llm(CONFIG, enable_prefix_caching=False)
    spec = cached.plan.rings.spec
    frontier = len(prompts["a"]) + GREEDY.max_tokens - 1
    assert spec.resumable(frontier, 200) and not spec.resumable(frontier, 120)
    for key in ("a", "too_far", "resumable"):  # too_far before resumable: a's checkpoint is its only match
        on = cached.generate([prompts[key]], GREEDY)[0]
        off = uncached.generate([prompts[key]], GREEDY)[0]
        assert on.outputs[0].token_ids == off.outputs[0].token_ids, key
        assert off.num_cached_tokens == 0
        if key == "resumable":
            assert on.num_cached_tokens == 200
        if key == "too_far":
            assert on.num_cached_tokens == 0  # a's checkpoint matches 120 tokens, its snapshot starts later
    snapshots = cached.engine.ring_snapshots
    assert snapshots.restored >= 1 and snapshots.taken >= 2
    cached.clear_cache()
    assert snapshots.free_slots == cached.plan.rings.spec.snapshots == 2  # nothing held, nothing leaked


@pytest.mark.slow  # for the suite's time: the default run resumes snapshots through prefix reuse above
def test_completions_of_one_prompt_fork_its_snapshot(prompts):
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=7, n=2, ignore_eos=True)
    llm = _llm(CONFIG, max_num_seqs=4)
    forked = llm.generate([prompts["resumable"]], params)[0]
    assert llm.engine.ring_snapshots.restored == 2  # each completion resumed from the prompt's snapshot
    alone = _llm(CONFIG, max_num_seqs=4, enable_prefix_caching=False)
    assert alone.engine.ring_snapshots is None and not alone.engine.forks
    assert [o.token_ids for o in forked.outputs] == [o.token_ids for o in alone.generate([prompts["resumable"]],
                                                                                          params)[0].outputs]


def test_more_retained_sequences_than_slots_evict_the_oldest(prompts):
    llm = _llm(CONFIG, max_num_seqs=1)  # one row, one snapshot slot
    rng = np.random.default_rng(5)
    others = [rng.integers(0, CONFIG.vocab_size, 90).tolist() for _ in range(3)]
    for p in others:
        llm.generate([p], GREEDY)
    again = llm.generate([others[-1] + [1, 2, 3]], GREEDY)[0]
    assert again.num_cached_tokens == len(others[-1])  # the newest kept its snapshot
    first = llm.generate([others[0] + [1, 2, 3]], GREEDY)[0]
    assert first.num_cached_tokens == 0  # the oldest gave its slot up
    assert llm.engine.ring_snapshots.free_slots == 0
    llm.clear_cache()
    assert llm.engine.ring_snapshots.free_slots == 1


def test_a_state_lost_to_a_failed_step_takes_the_ring_snapshots_with_it(prompts):
    """A fresh state (the step consumed the old one) holds no ring: a checkpoint whose pages the Host
    tier restores is still lost, since its ring snapshot is gone; the engine then reuses nothing."""
    import jax

    llm = _llm(CONFIG, host_memory="64MiB")
    llm.generate([prompts["a"]], GREEDY)
    engine = llm.engine
    (entry,) = list(engine.cache.index)
    engine.runner.offload_checkpoint(entry.value)  # every page of it has a Host replica now
    for leaf in jax.tree_util.tree_leaves(engine.runner.state):
        leaf.delete()
    lost_sequences, lost_checkpoints = engine.runner.repair()
    assert entry.value in lost_checkpoints and not lost_sequences
    engine._handle_lost(lost_sequences, lost_checkpoints)
    assert len(engine.cache) == 0 and engine.ring_snapshots.free_slots == 2
    again = llm.generate([prompts["resumable"]], GREEDY)[0]
    alone = _llm(CONFIG, enable_prefix_caching=False).generate([prompts["resumable"]], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == alone.outputs[0].token_ids
