"""Shared pieces of the engine tests.

One tiny float32 Llama checkpoint per process (vocabulary 256, 2 layers, hidden 128), engines over
it that all use the same context (:data:`MAX_MODEL_LEN`) and batch buckets (:data:`MAX_NUM_SEQS`)
so they reuse the compiled steps, and the reference every engine result is compared with: the same
request served alone by :class:`~ninfer_kv.models.generate.PagedGenerator` (one generator, its
greedy results kept per prompt so each is computed once).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

_MODEL_TESTS = str(Path(__file__).resolve().parents[1] / "models")
if _MODEL_TESTS not in sys.path:  # hf_fixtures lives beside the model tests (a rootdir module there)
    sys.path.insert(0, _MODEL_TESTS)

from hf_fixtures import FAMILY_CONFIGS, random_tensors, write_checkpoint  # noqa: E402

from ninfer_kv.engine import LLM, DecoderModel, EngineCore, RequestOutput  # noqa: E402
from ninfer_kv.models.generate import PagedGenerator  # noqa: E402
from ninfer_kv.schema.kinds import PoolKind  # noqa: E402

VOCAB = 256
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_TOKENS = 8
"""The longest ``max_tokens`` the tests ask for (the reference computes this many once per prompt)."""

HF_CONFIG = dict(FAMILY_CONFIGS["llama"], vocab_size=VOCAB, torch_dtype="float32")


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> Path:
    """The checkpoint directory (written once per process, removed at exit)."""
    root = Path(tempfile.mkdtemp(prefix="ninfer-engine-test-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return write_checkpoint(root / "llama", HF_CONFIG, random_tensors(HF_CONFIG, seed=1, dtype="F32"))


def write_model_files(directory: Path) -> Path:
    """A copy of the checkpoint's config and weights in ``directory`` (to add tokenizer files to)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(checkpoint_dir() / name, directory / name)
    return directory


@functools.lru_cache(maxsize=None)
def loaded():
    """The loaded checkpoint (float32 parameters)."""
    from ninfer_kv.models.hf import load_checkpoint

    return load_checkpoint(checkpoint_dir(), dtype="float32", max_context=MAX_MODEL_LEN)


def decoder_model() -> DecoderModel:
    """A fresh :class:`DecoderModel` over the shared parameters."""
    m = loaded()
    return DecoderModel(m.params, m.config)


def make_llm(*, max_num_seqs: int = MAX_NUM_SEQS, kv_capacity=MAX_NUM_SEQS * MAX_MODEL_LEN, model=None,
             **kwargs) -> LLM:
    """An :class:`LLM` over the shared model (token ids in and out)."""
    return LLM(model if model is not None else decoder_model(), max_model_len=MAX_MODEL_LEN,
               max_num_seqs=max_num_seqs, kv_capacity=kv_capacity, **kwargs)


class Reference:
    """Requests served alone by one :class:`PagedGenerator` (greedy), each prompt computed once."""

    def __init__(self):
        m = loaded()
        self.gen = PagedGenerator(m.params, m.config, max_context=MAX_MODEL_LEN, max_batch=1, keep_logits=True)
        self.results: dict[tuple, tuple[list, list]] = {}

    def _run(self, prompt) -> tuple[list, list]:
        key = tuple(int(t) for t in prompt)
        if key not in self.results:
            k = min(MAX_TOKENS, MAX_MODEL_LEN - len(key))
            seq = self.gen.generate([list(key)], max_new_tokens=k)[0]
            self.results[key] = (list(seq.generated), [np.asarray(x, np.float32) for x in seq.logits])
        return self.results[key]

    def greedy(self, prompt, max_tokens: int) -> list[int]:
        """The first ``max_tokens`` greedy tokens of ``prompt`` (at most :data:`MAX_TOKENS`)."""
        assert max_tokens <= MAX_TOKENS
        return self._run(prompt)[0][:max_tokens]

    def logits(self, prompt, max_tokens: int) -> list[np.ndarray]:
        """The float32 logits that chose each of those tokens."""
        assert max_tokens <= MAX_TOKENS
        return self._run(prompt)[1][:max_tokens]


@functools.lru_cache(maxsize=None)
def reference() -> Reference:
    """The process's :class:`Reference`."""
    return Reference()


def drain(engine: EngineCore, limit: int = 2000) -> dict[str, RequestOutput]:
    """Step until no request is unfinished; the finished outputs by request id."""
    done: dict[str, RequestOutput] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"the engine did not finish its requests in {limit} rounds "
                         f"(waiting {engine.num_waiting}, running {engine.num_running})")


def check_engine(engine: EngineCore) -> None:
    """The store's invariants, leased rows of every running sequence, and the prefix indexes."""
    store = engine.store
    store.audit_invariants()
    active = set(int(r) for r in store.active_rows())
    rows = [s.row for s in engine.running]
    assert len(rows) == len(set(rows)), f"two running sequences share a row: {rows}"
    for s in engine.running:
        assert store.row(s.handle) == s.row and s.row in active, f"sequence on row {s.row} is not leased"
    assert len(active) == len(engine.running) <= engine.max_num_seqs
    assert store.occupancy().active_spaces == len(engine.running)
    engine.cache.index.check()
    engine.pending.check()
    engine.waiting_index.check()
    # the waiting index holds every waiting prompt (of 2 tokens or more), each entry under the prompt of
    # one of its requests, so the prefix waiting requests share is never overstated
    indexed = []
    for entry in engine.waiting_index:
        assert entry.value and any(np.array_equal(r.prompt_ids, entry.tokens) for r in entry.value), entry
        for r in entry.value:
            assert np.array_equal(entry.tokens[: r.prompt_ids.size], r.prompt_ids)
        indexed += [r.request_id for r in entry.value]
    want = [r.request_id for r in engine.waiting if r.prompt_ids.size >= 2] if engine.caching else []
    assert sorted(indexed) == sorted(want), (indexed, want)
    for entry in engine.cache.index:
        assert store.checkpoint(entry.value).frontiers[PoolKind.MAIN] == entry.length, "an entry's KV != its tokens"


def assert_store_empty(engine: EngineCore) -> None:
    """After every request finished and ``clear_cache()``: the store holds nothing."""
    assert not engine.has_unfinished() and not engine.running and not engine.jobs
    engine.clear_cache()
    engine.store.audit_invariants()
    occ = engine.store.occupancy()
    assert (occ.allocated, occ.reserved, occ.active_spaces, occ.retained_checkpoints) == (0, 0, 0, 0), occ
    assert len(engine.cache) == 0 and len(engine.pending) == 0 and len(engine.waiting_index) == 0
    assert engine.store.checkpoints() == [] and engine.store.sequences() == []
    host = engine.store.host_occupancy()
    if host is not None:
        assert host.arena.extent_count == 0, host
