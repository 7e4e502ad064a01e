"""Serve your own model with the engine: a model written in plain JAX behind ``LLM``.

The engine (``ninfer_kv.engine``) owns the store, the device state, the request queue, prefix
reuse and batching; a model only runs steps.  Anything with the attributes and methods of
``ninfer_kv.engine.EngineModel`` can be served::

    vocab_size, prefill_chunk                  # token ids in [0, vocab_size); tokens per prefill call
    kv_config(profile) -> ModelKVConfig        # what the Main pool stores: layers, KV heads, head dim
    prepare(layout, batch_buckets)             # once, before any step: the Main layout and batch sizes
    prefill(state, work, tokens, positions, valid, table_rows, sampling=None) -> (state, StepOutput)
    decode(state, work, tokens, positions, valid, table_rows, sampling=None)  -> (state, StepOutput)

Both steps take the device state (donated) and the round's work, apply the work first
(``ninfer_kv.apply_work``), run the model through ``ninfer_kv.ops.paged_append`` /
``ops.paged_attention`` over one layer view per layer (``state.view``), and return the new state with
``StepOutput(next_tokens (B,), logits (B, V))`` taken at each row's last valid token.  Row ``b``
appends ``valid[b]`` tokens at positions ``positions[b] ..`` into execution row ``table_rows[b]``;
``B`` is one of the batch buckets and padding rows have ``valid == 0`` (they write and read nothing).

The toy model here (embedding + sinusoidal positions, two layers of attention and
MLP, a normalized output projection) is the one of ``examples/step_function.py``, served by ``LLM`` instead of a
hand-written loop.  The script generates greedily, reuses a cached prefix for a second request,
samples with a seed, and checks the greedy tokens against a dense (no cache) forward of the same
model.

Run:  python examples/engine_custom_model.py   (a few seconds on a CPU)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv import ops
from ninfer_kv.device import apply_work
from ninfer_kv.ops.codecs import codec_roundtrip
from ninfer_kv.engine import LLM, SamplingParams, StepOutput
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.models.decoder.sampling import sample_tokens
from ninfer_kv.planning import ModelKVConfig
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.schema.profiles import KVProfile

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, D_MODEL, MLP_DIM, VOCAB = 2, 2, 4, 64, 128, 256, 256
MAIN = PoolKind.MAIN


def init_weights(seed: int = 0) -> dict[str, jax.Array]:
    """Random weights of the toy model (float32)."""
    rng = np.random.default_rng(seed)
    shapes = {"embed": (VOCAB, D_MODEL), "wq": (LAYERS, D_MODEL, Q_HEADS * HEAD_DIM),
              "wk": (LAYERS, D_MODEL, KV_HEADS * HEAD_DIM), "wv": (LAYERS, D_MODEL, KV_HEADS * HEAD_DIM),
              "wo": (LAYERS, Q_HEADS * HEAD_DIM, D_MODEL), "w_up": (LAYERS, D_MODEL, MLP_DIM),
              "w_down": (LAYERS, MLP_DIM, D_MODEL), "out": (D_MODEL, VOCAB)}
    scale = {"embed": 1.0}  # unit embeddings; every matrix scaled by 1/sqrt(fan-in)
    return {name: jnp.asarray(rng.standard_normal(shape, np.float32) * scale.get(name, 1 / np.sqrt(shape[-2])))
            for name, shape in shapes.items()}


def embed(w, tokens, positions):
    """Token embeddings plus sinusoidal encodings of the absolute ``positions`` (same shape as tokens)."""
    freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(D_MODEL // 2) / (D_MODEL // 2))
    angles = positions[..., None].astype(jnp.float32) * freqs
    return w["embed"][tokens] + 0.5 * jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def unembed(w, x):
    """float32 logits of the hidden states ``x (..., D_MODEL)``."""
    return (rms_norm(x) @ w["out"]).astype(jnp.float32)


def mlp(w, x, layer):
    return jax.nn.gelu(rms_norm(x) @ w["w_up"][layer]) @ w["w_down"][layer]


def qkv(w, x, layer):
    b, t, _ = x.shape
    x = rms_norm(x)
    return ((x @ w["wq"][layer]).reshape(b, t, Q_HEADS, HEAD_DIM),
            (x @ w["wk"][layer]).reshape(b, t, KV_HEADS, HEAD_DIM),
            (x @ w["wv"][layer]).reshape(b, t, KV_HEADS, HEAD_DIM))


class ToyModel:
    """The toy model as an ``EngineModel`` (module docstring).

    Args:
      weights: :func:`init_weights`'s dict.
      prefill_chunk: tokens per prefill call (a multiple of 64).
    """

    vocab_size = VOCAB

    def __init__(self, weights: dict[str, jax.Array], *, prefill_chunk: int = 64):
        self.weights = weights
        self.prefill_chunk = prefill_chunk
        self.layout: PagedKVStorageLayout | None = None
        self.batch_buckets: tuple[int, ...] = ()
        self.traces: list[tuple[str, tuple[int, int], bool]] = []  # (step, (B, T), sampled) per compilation

    def kv_config(self, profile) -> ModelKVConfig:
        return ModelKVConfig(LAYERS, KV_HEADS, HEAD_DIM, KVProfile.parse(profile))

    def prepare(self, layout: PagedKVStorageLayout, batch_buckets) -> None:
        # The Main pool's layout, as the engine's store planned it from kv_config(profile).
        self.layout = layout
        self.batch_buckets = tuple(batch_buckets)
        step = functools.partial(jax.jit, donate_argnums=1)  # the state is donated: appends write in place
        self._prefill = step(functools.partial(self._step, "prefill"))
        self._decode = step(functools.partial(self._step, "decode"))

    def prefill(self, state, work, tokens, positions, valid, table_rows, sampling=None):
        return self._run(self._prefill, state, work, tokens, positions, valid, table_rows, sampling)

    def decode(self, state, work, tokens, positions, valid, table_rows, sampling=None):
        return self._run(self._decode, state, work, tokens, positions, valid, table_rows, sampling)

    def _run(self, fn, state, work, tokens, positions, valid, table_rows, sampling):
        if self.layout is None:
            raise RuntimeError("prepare(layout, batch_buckets) must run before any step")
        if tokens.shape[0] not in self.batch_buckets:
            raise ValueError(f"batch of {tokens.shape[0]} rows is not one of the buckets {self.batch_buckets}")
        return fn(self.weights, state, work, tokens, positions, valid, table_rows, sampling)

    def _step(self, name, w, state, work, tokens, positions, valid, table_rows, sampling):
        """One jitted step: apply the work, run the layers over the paged cache, choose the next tokens."""
        self.traces.append((name, tuple(tokens.shape), sampling is not None))
        state = apply_work(state, work)  # the block-table entries mapped since the last step
        b, t = tokens.shape
        x = embed(w, tokens, positions[:, None] + jnp.arange(t, dtype=jnp.int32))  # (B, T, D_MODEL)
        for layer in range(LAYERS):
            view = state.view(MAIN, layer)
            q, k, v = qkv(w, x, layer)
            view = ops.paged_append(view, table_rows, positions, k, v, valid)  # tokens t < valid[b] only
            out = ops.paged_attention(q, view, table_rows, positions, positions + valid)
            state = state.replace_planes(MAIN, view.planes)
            x = x + out.reshape(b, t, -1) @ w["wo"][layer]
            x = x + mlp(w, x, layer)
        last = jnp.maximum(valid - 1, 0)  # each row's last valid token (0 for padding rows)
        logits = unembed(w, x[jnp.arange(b), last])  # (B, VOCAB)
        if sampling is None:
            next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:  # drawn with each row's key folded with the position of the token it produces
            next_tokens = sample_tokens(logits, sampling, positions + valid)
        return state, StepOutput(next_tokens, logits)


# -- the same model without a cache --------------------------------------------------------------------
DENSE_LEN = 256


@functools.partial(jax.jit, static_argnums=0)
def dense_logits(profile, w, tokens):
    """Logits ``(DENSE_LEN, VOCAB)`` of one sequence padded at the end (causal: padding is invisible),
    K/V through the profile's codec round trip as the cache stores them."""
    x = embed(w, tokens, jnp.arange(DENSE_LEN))[None]
    mask = jnp.tril(jnp.ones((DENSE_LEN, DENSE_LEN), bool))
    for layer in range(LAYERS):
        q, k, v = qkv(w, x, layer)
        k, v = codec_roundtrip(profile, k, v)
        k, v = (jnp.repeat(a, Q_HEADS // KV_HEADS, axis=2) for a in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        p = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(1, DENSE_LEN, -1) @ w["wo"][layer]
        x = x + mlp(w, x, layer)
    return unembed(w, x[0])


def dense_greedy(profile, w, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` recomputed from scratch at every step (no cache)."""
    seq = list(prompt)
    for _ in range(max_tokens):
        logits = dense_logits(profile, w, jnp.asarray(np.pad(seq, (0, DENSE_LEN - len(seq))), jnp.int32))
        seq.append(int(jnp.argmax(logits[len(seq) - 1])))
    return seq[len(prompt):]


def main() -> dict:
    """Serve the toy model, print the outputs, check them; returns the results (for the tests)."""
    profile = KVProfile.BF16
    model = ToyModel(init_weights(seed=0))
    llm = LLM(model=model, kv_cache_dtype=profile.value, max_model_len=DENSE_LEN, max_num_seqs=4, kv_capacity=4096)

    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 100).tolist()  # a prefix both requests share
    first = system + rng.integers(0, VOCAB, 30).tolist()
    greedy = SamplingParams(max_tokens=8, temperature=0)
    out1 = llm.generate([first], greedy)[0]
    print(f"request 1: {len(first)} prompt tokens -> {out1.outputs[0].token_ids} "
          f"(cached tokens {out1.num_cached_tokens})")

    second = system + rng.integers(0, VOCAB, 20).tolist()  # shares the 100-token prefix with request 1
    out2 = llm.generate([second], greedy)[0]
    print(f"request 2: {len(second)} prompt tokens -> {out2.outputs[0].token_ids} "
          f"(cached tokens {out2.num_cached_tokens}: the shared prefix was not recomputed)")

    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, n=2)
    out3 = llm.generate([second], sampled)[0]
    print(f"request 3 (request 2's prompt, temperature 0.8, top-p 0.9, seed 7, n=2): "
          f"{[c.token_ids for c in out3.outputs]} (cached tokens {out3.num_cached_tokens})")

    for prompt, out in ((first, out1), (second, out2)):
        assert out.outputs[0].token_ids == dense_greedy(profile, model.weights, prompt, 8), \
            "greedy tokens differ from the dense recomputation"
    print("dense check: OK")
    print(f"steps compiled for {sorted(set(model.traces))}")
    return {
        "greedy": [out1.outputs[0].token_ids, out2.outputs[0].token_ids],
        "cached_tokens": [out1.num_cached_tokens, out2.num_cached_tokens],
        "shared_prefix": len(system),
        "sampled": [c.token_ids for c in out3.outputs],
        "sampled_cached_tokens": out3.num_cached_tokens,
        "traces": list(model.traces),
        "stats": llm.engine.stats,
    }


if __name__ == "__main__":
    main()
