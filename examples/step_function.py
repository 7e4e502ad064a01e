"""A paged KV cache under your own jitted step function, end to end, in the step API.

    plan -> store + device state -> [begin_step -> jitted step (state donated) -> end_step]*
         -> finish(retain) -> fork two sequences from the checkpoint -> release

The store is host-only bookkeeping; the caller owns the ``KVDeviceState`` (planes and block tables)
and threads it through its step.  Each unit is three calls: ``begin_step`` maps pages for the new
tokens and takes the store's round work into an ``AttentionBatch`` (rows, positions, token counts,
the work); the jitted step calls ``attention(state, batch, layer, q, k, v)`` once per layer, which
applies the work on its first call, appends k/v and attends; ``end_step`` commits the tokens.  The
state is donated, so appends happen in place: one dispatch per unit (two in the unit after the
fork, whose copy-on-write of the shared tail is applied alone first).

Page IDs, rows, positions and lengths are array data, so the step compiles once per shape of its
token batch ``(B, T)``, however pages are assigned.  This script calls it 11 times in 3 shapes and
so compiles it 3 times: ``(1, 128)`` for the shared prefix alone (2 prefill chunks of up to 128
tokens), ``(2, 128)`` for the two forks' suffixes (1 chunk) and ``(2, 1)`` for the 8 decode steps;
the final line prints the traced shapes.  At the end the served logits are checked against a dense
recomputation with the same K8V4 codec round trip.  The full protocol behind these calls
(``take_step_work``, ``apply_work``, views and ``ninfer_kv.ops``) is in docs/API.md.

Run:  python examples/step_function.py   (a few seconds on a CPU)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv import (ExplicitCapacity, KVStore, ModelKVConfig, allocate_state, attention, begin_step, end_step,
                       ops, plan_kv_cache)

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, D_MODEL, VOCAB, CHUNK = 2, 2, 4, 64, 128, 256, 128

# 1. Plan the pool (max context 512, 2 concurrent sequences, 16 pages of 64 tokens) and build the store.
plan = plan_kv_cache(ModelKVConfig(LAYERS, KV_HEADS, HEAD_DIM, profile="k8v4"),
                     max_context=512, max_concurrency=2, policy=ExplicitCapacity(16 * 64))
store = KVStore(plan)
state = allocate_state(store)                                   # caller-owned planes + block tables
PROFILE = store.layout().profile

# 2. A toy model: embeddings, per-layer q/k/v/o projections (your model goes here).
rng = np.random.default_rng(0)
w = {name: jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])) for name, shape in {
    "embed": (VOCAB, D_MODEL), "wq": (LAYERS, D_MODEL, Q_HEADS * HEAD_DIM),
    "wk": (LAYERS, D_MODEL, KV_HEADS * HEAD_DIM), "wv": (LAYERS, D_MODEL, KV_HEADS * HEAD_DIM),
    "wo": (LAYERS, Q_HEADS * HEAD_DIM, D_MODEL)}.items()}


def qkv(x, layer):
    b, t, _ = x.shape
    return ((x @ w["wq"][layer]).reshape(b, t, Q_HEADS, HEAD_DIM),
            (x @ w["wk"][layer]).reshape(b, t, KV_HEADS, HEAD_DIM),
            (x @ w["wv"][layer]).reshape(b, t, KV_HEADS, HEAD_DIM))


# 3. The jitted step: state donated (argument 0) and returned; the batch and tokens are data.
TRACES = []  # the token shape (B, T) of every trace; each trace is one compilation (3 in this script)


@functools.partial(jax.jit, donate_argnums=0)
def step(state, batch, tokens):
    TRACES.append(tokens.shape)
    x = w["embed"][tokens]                                       # (B, T, D_MODEL)
    for layer in range(LAYERS):
        q, k, v = qkv(x, layer)
        state, out = attention(state, batch, layer, q, k, v)     # append tokens t < num_tokens[b], attend
        x = x + out.reshape(x.shape[0], x.shape[1], -1) @ w["wo"][layer]
    return state, x @ w["embed"].T                               # logits (B, T, VOCAB)


def run(handles, tokens, valid):
    """One unit: begin (pages, work), the step (one dispatch; after the fork two), end (commit)."""
    global state
    state, batch = begin_step(store, state, handles, valid)
    state, logits = step(state, batch, tokens.astype(np.int32))
    end_step(store, batch)                                       # only after the step succeeded
    return np.asarray(logits)


def generate(handles, prompts, starts, new_tokens):
    """Chunked prefill of ``prompts[i][starts[i]:]``, then greedy decode; returns (tokens, logits) per row."""
    n = len(handles)
    pos = np.array(starts)
    ends = np.array([len(p) for p in prompts])
    last = np.zeros((n, VOCAB), np.float32)
    while (pos < ends).any():
        valid = np.minimum(CHUNK, ends - pos)
        chunk = np.zeros((n, CHUNK), np.int64)
        for i, p in enumerate(prompts):
            chunk[i, : valid[i]] = p[pos[i] : pos[i] + valid[i]]
        logits = run(handles, chunk, valid)
        done = valid > 0
        last[done] = logits[done, valid[done] - 1]
        pos = pos + valid
    out_tokens, out_logits = [[] for _ in range(n)], [[] for _ in range(n)]
    for _ in range(new_tokens):
        tok = last.argmax(-1)
        for i in range(n):
            out_tokens[i].append(int(tok[i]))
            out_logits[i].append(last[i].copy())
        last = run(handles, tok[:, None], 1)[:, 0]
        pos = pos + 1
    return out_tokens, out_logits


@jax.jit
def dense_logits(tokens):
    """The same model without a cache: causal attention over the codec round trip of K/V.

    ``tokens`` is one sequence padded at the end to a fixed length (causal: padding is invisible).
    """
    x = w["embed"][tokens][None]
    s = x.shape[1]
    mask = jnp.tril(jnp.ones((s, s), bool))
    for layer in range(LAYERS):
        q, k, v = qkv(x, layer)
        k, v = ops.codecs.codec_roundtrip(PROFILE, k, v)
        k, v = (jnp.repeat(a, Q_HEADS // KV_HEADS, axis=2) for a in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        p = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(1, s, -1) @ w["wo"][layer]
    return (x @ w["embed"].T)[0]


def main():
    system = rng.integers(0, VOCAB, 150)                          # a shared prefix of 150 tokens
    a_prompt = np.concatenate([system, rng.integers(0, VOCAB, 30)])

    # A sequence of just the system prompt: activate (reserves 3 pages), prefill, retain.
    a = store.activate(len(system), 0)
    generate([a], [system], [0], 0)
    ckpt = store.finish(a, retain=True)                          # immutable checkpoint at frontier 150

    # Two requests fork the checkpoint: 2 full pages shared, the 22-column tail copied (COW);
    # each reserves its prompt + 8 new tokens and prefills only its own suffix.
    b_prompt = np.concatenate([system, rng.integers(0, VOCAB, 50)])
    a2 = store.activate(len(a_prompt), 8, source=ckpt)
    b = store.activate(len(b_prompt), 8, source=ckpt)
    assert store.address_space(b).pages()[0].references == 3     # checkpoint + two forks
    tokens, logits = generate([a2, b], [a_prompt, b_prompt], [150, 150], 8)

    for prompt, toks, logs in zip([a_prompt, b_prompt], tokens, logits):
        seq = np.concatenate([prompt, toks[:-1]])
        dense = np.asarray(dense_logits(np.pad(seq, (0, 256 - seq.size))))[len(prompt) - 1 : seq.size]
        assert toks == dense.argmax(-1).tolist(), "greedy tokens differ from the dense recomputation"
        np.testing.assert_allclose(np.stack(logs), dense, atol=2e-3, rtol=0)

    for h in (a2, b):
        store.finish(h)                                          # release rows, pages, reservations
    store.release_checkpoint(ckpt)
    main_pool = store.pool("main")
    assert main_pool.allocated == main_pool.reserved == 0
    store.audit_invariants()
    store.require_synced(state)                                     # every round work applied once, in order
    print(f"ok: 2 sequences forked a 150-token prefix, 8 tokens each match the dense model "
          f"(profile {PROFILE.value}, impl {ops.resolve_impl('auto').name}); "
          f"step traced for shapes {TRACES} only")


if __name__ == "__main__":
    main()
