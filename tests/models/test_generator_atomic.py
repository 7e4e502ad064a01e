"""PagedGenerator's verbs check every argument before they touch the store: a refused ``add``,
``generate``, ``release`` or ``run`` leaves the store as it was, and a ``max_batch=1`` generator
serves the next good request.  ``generate`` is all or nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_kv.schema.errors import PoolCapacityError
from ninfer_kv.models.decoder import ModelConfig, SamplingConfig, init_params
from ninfer_kv.models.generate import PagedGenerator
from ninfer_kv.models.request_checks import MAX_NEW_TOKENS

CFG = ModelConfig.tiny()  # one config (and max_batch) for the whole file: the compiled steps are shared
V = CFG.vocab_size
PROMPT = [5, 6, 7]
REFUSED = (TypeError, ValueError)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


def _gen(params, **kw) -> PagedGenerator:
    return PagedGenerator(params, CFG, **{"max_context": 128, "max_batch": 1, **kw})


@pytest.fixture(scope="module")
def expected(params):
    """The greedy continuation of PROMPT by a generator that never saw a refused call."""
    return _gen(params).generate([PROMPT], max_new_tokens=3)[0].generated


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    return a == b


def _state(gen: PagedGenerator):
    return gen.store.snapshot(), list(gen.active)


def _usage(gen: PagedGenerator):
    """Rows leased, pages held and reserved, sequences and checkpoints (not the counters a
    finished activation advances)."""
    occ = gen.store.occupancy()
    return (occ.allocated, occ.reserved, occ.available, occ.active_spaces, occ.retained_checkpoints,
            gen.store.active_rows().tolist(), len(gen.store.sequences()), len(gen.store.checkpoints()),
            list(gen.active))


def _refused(gen, call, error, match):
    before = _state(gen)
    with pytest.raises(error, match=match):
        call()
    assert _same(_state(gen), before)


@pytest.fixture(scope="module")
def held(params):
    """A generator holding a retained checkpoint (``parent``) and a released one (``gone``)."""
    gen = _gen(params)
    parent = gen.add(PROMPT, max_new_tokens=2, retain=True)
    gen.run()
    gone = gen.add([9, 10], max_new_tokens=1, retain=True)
    gen.run()
    gen.release(gone)
    plain = gen.add([11, 12], max_new_tokens=1)
    gen.run()
    return gen, parent, gone, plain


def test_add_refuses_bad_arguments_before_the_store(params, expected):
    gen = _gen(params)
    other = _gen(params)
    foreign = other.add(PROMPT, max_new_tokens=1, retain=True)
    other.run()
    cases = [
        (dict(stop_tokens=2), TypeError, r"stop_tokens=2 is a single token id; pass a list such as \[2\]"),
        (dict(stop_tokens=np.int64(4)), TypeError, r"pass a list such as \[4\]"),
        (dict(stop_tokens=["x"]), TypeError, r"stop_tokens\[0\]='x' is not a token id; token ids are integers in \[0, 256\)"),
        (dict(stop_tokens="ab"), TypeError, "stop_tokens must be a list of token ids"),
        (dict(stop_tokens=None), TypeError, "stop_tokens must be an iterable"),
        (dict(stop_tokens=[1, V]), ValueError, r"stop_tokens\[1\]=256 is outside the vocabulary \[0, 256\)"),
        (dict(prompt=[5.7, 6]), TypeError, r"prompt\[0\]=5.7 is not a token id; token ids are integers in \[0, 256\)"),
        (dict(prompt=[5, 5.0]), TypeError, r"prompt\[1\]=5.0 is not a token id"),
        (dict(prompt=[True]), TypeError, r"prompt\[0\]=True is not a token id"),
        (dict(prompt=[1, "3"]), TypeError, r"prompt\[1\]='3' is not a token id"),
        (dict(prompt=np.array([1.0, 2.0])), TypeError, r"prompt\[0\]=.*1\.0.* is not a token id"),
        (dict(prompt=np.array([[1, 2]])), TypeError, r"prompt must be one-dimensional"),
        (dict(prompt=np.array([1, -2])), ValueError, r"prompt\[1\]=-2 is outside the vocabulary \[0, 256\)"),
        (dict(prompt=[1, 2, 999]), ValueError, r"prompt\[2\]=999 is outside the vocabulary \[0, 256\)"),
        (dict(prompt="hello"), TypeError, "prompt must be a list of token ids"),
        (dict(prompt=7), TypeError, "prompt must be an iterable of token ids"),
        (dict(prompt=[]), ValueError, "prompt is empty"),
        (dict(prompt=[1] * 128), ValueError, r"prompt has 128 tokens; max_context=128 leaves no room"),
        (dict(max_new_tokens=0), ValueError, r"max_new_tokens=0 is invalid; it must be an integer in \[1, "),
        (dict(max_new_tokens=MAX_NEW_TOKENS + 1), ValueError, "max_new_tokens=2147483585 is invalid"),
        (dict(max_new_tokens=4.0), TypeError, "max_new_tokens=4.0 is invalid"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens=True is invalid"),
        (dict(max_new_tokens=None), TypeError, "max_new_tokens=None is invalid"),
        (dict(sampling={"temperature": 1.0}), TypeError, "sampling must be a SamplingConfig, got dict"),
        (dict(retain="yes"), TypeError, "retain='yes' is invalid; it must be True or False"),
        (dict(retain=1), TypeError, "retain=1 is invalid"),
        (dict(source="parent"), TypeError, "source must be a GeneratedSequence of this generator, got str"),
        (dict(prompt=PROMPT + [1], source=foreign), ValueError, "source belongs to another generator"),
    ]
    for kw, error, match in cases:
        args = {"max_new_tokens": 3, **kw}
        prompt = args.pop("prompt", PROMPT)
        _refused(gen, lambda: gen.add(prompt, **args), error, match)
    # a config whose values were changed after construction is checked again
    tampered = SamplingConfig(temperature=1.0)
    object.__setattr__(tampered, "temperature", -1.0)
    _refused(gen, lambda: gen.add(PROMPT, max_new_tokens=3, sampling=tampered), ValueError, "temperature=-1.0")
    # numpy integers are token ids and counts
    seq = gen.add(np.array(PROMPT, np.int32), max_new_tokens=np.int64(3), stop_tokens=np.array([V - 1]))
    assert seq.tokens == PROMPT and seq.stop_tokens == {V - 1}
    # the store's own refusal (every row leased) changes nothing either
    _refused(gen, lambda: gen.add(PROMPT, max_new_tokens=3), PoolCapacityError, "execution rows are leased")
    gen.run()
    assert seq.generated == expected
    assert gen.generate([PROMPT], max_new_tokens=3)[0].generated == expected
    gen.store.audit_invariants()


def test_fork_sources_must_be_held_checkpoints_of_this_generator(held, expected):
    gen, parent, gone, plain = held
    extended = parent.tokens + [1]
    cases = [
        (gone, gone.tokens + [1], "source's checkpoint was released"),
        (plain, plain.tokens + [1], r"added with retain=True \(added without retain\)"),
        (parent, parent.tokens[:-1], "must extend its source's 4 tokens by at least one token"),
        (parent, [1, 2, 3, 4, 5, 6], "must extend its source's 4 tokens"),
    ]
    for source, prompt, match in cases:
        _refused(gen, lambda: gen.add(prompt, max_new_tokens=2, source=source), ValueError, match)
    fork = gen.add(extended, max_new_tokens=2, retain=True, source=parent)
    _refused(gen, lambda: gen.add(fork.tokens + [1], max_new_tokens=2, source=fork), ValueError,
             r"added with retain=True \(still active\)")
    _refused(gen, lambda: gen.release(fork), ValueError, "seq is still active")
    _refused(gen, lambda: gen.release("fork"), TypeError, "seq must be a GeneratedSequence of this generator")
    other = _gen(gen.params)
    _refused(other, lambda: other.release(parent), ValueError, "seq belongs to another generator")
    _refused(gen, lambda: gen.run(on_token=5), TypeError, "on_token must be a function")
    gen.run()
    assert fork.done and fork.checkpoint is not None
    gen.release(fork)
    gen.release(fork)  # nothing left to release
    gen.release(plain)
    assert gen.generate([PROMPT], max_new_tokens=3)[0].generated == expected


def test_generate_is_all_or_nothing(params, expected):
    gen = _gen(params)
    before = _state(gen)
    for prompts, kw, error, match in [
        ([PROMPT, [1, 999]], {}, ValueError, r"prompts\[1\]\[1\]=999 is outside the vocabulary"),
        ([PROMPT, [1, 2.5]], {}, TypeError, r"prompts\[1\]\[1\]=2.5 is not a token id"),
        ([1, 2, 3], {}, TypeError, r"prompts\[0\]=1 is a token id, not a prompt"),
        ("1 2 3", {}, TypeError, "prompts must be a list of prompts"),
        ([PROMPT, PROMPT], dict(sampling=[SamplingConfig()]), ValueError, "1 sampling configs for 2 prompts"),
        ([PROMPT], dict(sampling=[None]), TypeError, r"sampling\[0\] must be a SamplingConfig"),
        ([PROMPT], dict(stop_tokens=2), TypeError, r"pass a list such as \[2\]"),
        ([PROMPT], dict(max_new_tokens=0), ValueError, "max_new_tokens=0"),
        ([PROMPT], dict(on_token="print"), TypeError, "on_token must be a function"),
    ]:
        with pytest.raises(error, match=match):
            gen.generate(prompts, **{"max_new_tokens": 3, **kw})
        assert _same(_state(gen), before)
    # the second activation finds every row leased: the first is undone, the error propagates
    usage = _usage(gen)
    with pytest.raises(PoolCapacityError):
        gen.generate([PROMPT, PROMPT], max_new_tokens=3)
    assert _usage(gen) == usage and not gen.active
    gen.store.audit_invariants()
    assert [s.generated for s in gen.generate([PROMPT], max_new_tokens=3)] == [expected]


def test_generate_undoes_its_adds_when_the_pages_run_out(params):
    gen = _gen(params, max_batch=2, kv_capacity=128)  # two pages: one sequence of 128 tokens
    usage = _usage(gen)
    with pytest.raises(PoolCapacityError):
        gen.generate([PROMPT, PROMPT], max_new_tokens=100)
    assert _usage(gen) == usage
    gen.store.audit_invariants()
    assert gen.store.pool("main").allocated == 0
    seqs = gen.generate([PROMPT, [8, 9]], max_new_tokens=2)
    assert all(s.finish_reason == "length" and len(s.generated) == 2 for s in seqs)


# -- random bad argument combinations -------------------------------------------------------------------

GOOD = {
    "prompt": st.sampled_from([PROMPT, [0, V - 1], np.array([3, 4], np.int64)]),
    "max_new_tokens": st.sampled_from([1, 5, np.int32(2), MAX_NEW_TOKENS]),
    "sampling": st.sampled_from([SamplingConfig(), SamplingConfig(temperature=0.7, top_k=5, seed=3)]),
    "stop_tokens": st.sampled_from([(), [1], (0, V - 1), np.array([2])]),
    "retain": st.sampled_from([False, True, np.bool_(True)]),
}
BAD = {
    "prompt": st.sampled_from([[], [5.7, 6], [5.0], [True], ["1"], [-1], [V], "12", 12, None, [1] * 128,
                               np.array([0.5]), [[1, 2]]]),
    "max_new_tokens": st.sampled_from([0, -3, 2.0, True, "4", None, MAX_NEW_TOKENS + 1, 10**30]),
    "sampling": st.sampled_from([None, "greedy", {"temperature": 0.0}, 0.7]),
    "stop_tokens": st.sampled_from([2, np.int64(2), "2", [V], [-1], [1.0], [None], None, [[1]]]),
    "retain": st.sampled_from([1, 0, "no", None]),
}


@st.composite
def bad_arguments(draw):
    names = sorted(GOOD)
    mask = draw(st.integers(1, 2 ** len(names) - 1))  # which arguments are bad: at least one
    args = {n: draw(BAD[n] if mask >> i & 1 else GOOD[n]) for i, n in enumerate(names)}
    args["source"] = draw(st.sampled_from(["none", "parent", "gone", "plain", "object"]))
    return args


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=bad_arguments())
def test_refused_adds_leave_the_store_unchanged(held, args):
    gen, parent, gone, plain = held
    source = {"none": None, "parent": parent, "gone": gone, "plain": plain, "object": object()}[args.pop("source")]
    prompt = args.pop("prompt")
    if hasattr(source, "tokens") and isinstance(prompt, list) and prompt:
        prompt = source.tokens + prompt  # a fork's prompt extends its source (an empty one stays empty)
    before = _state(gen)
    with pytest.raises(REFUSED):
        gen.add(prompt, source=source, **args)
    assert _same(_state(gen), before)
