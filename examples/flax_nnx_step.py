"""A Flax NNX model over the paged KV cache: the attention module calls ``ninfer_kv.attention``.

    plan -> store + device state -> [begin_step -> nnx.jit step (state donated) -> end_step]*

The model is an ordinary ``nnx.Module`` (embedding, pre-norm blocks of attention and a gated MLP,
a tied head).  Its attention module owns its projections and its layer index; the paged cache
arrives as two arguments threaded through the blocks: the caller-owned ``KVDeviceState`` (donated
to the step, returned by it) and the unit's ``AttentionBatch`` from ``begin_step``.  With no cache
(``state=None``) the same module attends densely over the BF16 round trip of its keys and values:
that is the reference the served tokens are checked against at the end.

Two prompts are prefilled in chunks of 32 tokens and decode 8 tokens each, side by side; the step
compiles once per token shape (B, T): (2, 32) and (2, 1).

Run:  python examples/flax_nnx_step.py   (a few seconds on a CPU; needs ``pip install flax``)
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ninfer_kv import (ExplicitCapacity, KVStore, ModelKVConfig, allocate_state, attention, begin_step, end_step,
                       plan_kv_cache)

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, D_MODEL, VOCAB, CHUNK = 2, 4, 2, 64, 128, 256, 32


class Attention(nnx.Module):
    def __init__(self, layer: int, *, rngs: nnx.Rngs):
        self.layer = layer
        self.q = nnx.Linear(D_MODEL, Q_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(D_MODEL, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(D_MODEL, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(Q_HEADS * HEAD_DIM, D_MODEL, use_bias=False, rngs=rngs)

    def __call__(self, x, state, batch):
        b, t, _ = x.shape
        q = self.q(x).reshape(b, t, Q_HEADS, HEAD_DIM)
        k = self.k(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        v = self.v(x).reshape(b, t, KV_HEADS, HEAD_DIM)
        if state is None:  # the dense reference: causal attention over the BF16 round trip of k, v
            out = dense_attention(q, k.astype(jnp.bfloat16).astype(x.dtype), v.astype(jnp.bfloat16).astype(x.dtype))
        else:
            state, out = attention(state, batch, self.layer, q, k, v)
        return self.o(out.reshape(b, t, -1)), state


def dense_attention(q, k, v):
    t = q.shape[1]
    k, v = (jnp.repeat(a, Q_HEADS // KV_HEADS, axis=2) for a in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class Block(nnx.Module):
    def __init__(self, layer: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(D_MODEL, rngs=rngs)
        self.attn = Attention(layer, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(D_MODEL, rngs=rngs)
        self.gate = nnx.Linear(D_MODEL, 2 * D_MODEL, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D_MODEL, 2 * D_MODEL, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D_MODEL, D_MODEL, use_bias=False, rngs=rngs)

    def __call__(self, x, state, batch):
        h, state = self.attn(self.attn_norm(x), state, batch)
        x = x + h
        y = self.mlp_norm(x)
        return x + self.down(nnx.silu(self.gate(y)) * self.up(y)), state


class TinyLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([Block(layer, rngs=rngs) for layer in range(LAYERS)])
        self.norm = nnx.RMSNorm(D_MODEL, rngs=rngs)

    def __call__(self, tokens, state=None, batch=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x, state = block(x, state, batch)
        return self.embed.attend(self.norm(x)), state        # logits (B, T, VOCAB), the new state


@nnx.jit(donate_argnums=1)
def step(model, state, batch, tokens):
    logits, state = model(tokens, state, batch)
    return state, logits


def main():
    model = TinyLM(rngs=nnx.Rngs(0))
    plan = plan_kv_cache(ModelKVConfig(LAYERS, KV_HEADS, HEAD_DIM, profile="bf16"),
                         max_context=256, max_concurrency=2, policy=ExplicitCapacity(8 * 64))
    store = KVStore(plan)
    state = allocate_state(store)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n) for n in (45, 70)]
    new_tokens = 8
    handles = [store.activate(len(p), new_tokens) for p in prompts]

    pos = np.zeros(2, np.int64)
    ends = np.array([len(p) for p in prompts])
    last = np.zeros((2, VOCAB), np.float32)
    while (pos < ends).any():                                        # chunked prefill, side by side
        counts = np.minimum(CHUNK, ends - pos)
        chunk = np.zeros((2, CHUNK), np.int32)
        for i, p in enumerate(prompts):
            chunk[i, : counts[i]] = p[pos[i] : pos[i] + counts[i]]
        state, batch = begin_step(store, state, handles, counts)
        state, logits = step(model, state, batch, chunk)
        end_step(store, batch)
        logits = np.asarray(logits)
        done = counts > 0
        last[done] = logits[done, counts[done] - 1]
        pos += counts

    generated = [[], []]
    for _ in range(new_tokens):                                      # greedy decode, one token per row
        tok = last.argmax(-1).astype(np.int32)
        for i in range(2):
            generated[i].append(int(tok[i]))
        state, batch = begin_step(store, state, handles, 1)
        state, logits = step(model, state, batch, tok[:, None])
        end_step(store, batch)
        last = np.asarray(logits)[:, 0]

    for prompt, toks in zip(prompts, generated):                     # the dense model agrees
        seq = jnp.asarray(np.concatenate([prompt, toks[:-1]]))[None]
        dense, _ = model(seq)
        assert toks == np.asarray(dense[0, len(prompt) - 1 :].argmax(-1)).tolist(), "tokens differ from dense"

    for h in handles:
        store.finish(h)
    store.require_synced(state)                                      # every round work applied once, in order
    store.audit_invariants()
    print(f"ok: a Flax NNX model decoded {new_tokens} tokens for 2 prompts over the paged cache, "
          f"the same tokens as its dense forward")


if __name__ == "__main__":
    main()
