"""The decoder's forward pass over the paged KV cache.

One decoder layer (pre-norm; bracketed parts are :class:`~ninfer_kv.models.decoder.config.ModelConfig`
options)::

    x = rms_norm(h, attn_norm)
    q = rope([q_norm](x @ wq [+ bq])), k = rope([k_norm](x @ wk [+ bk])), v = x @ wv [+ bv]   (per head)
    h = h + attention(q, k, v) @ wo [+ bo]
    h = h + swiglu(rms_norm(h, mlp_norm))            ([b_gate], [b_up], [b_down] with mlp_bias)

Projections are ``(out, in)`` matrices (``nn.Linear`` weights) contracted over ``in`` with float32
accumulation.  Logits are float32: ``rms_norm(h, final_norm)`` contracted with the LM head ``(V, d)``;
with tied embeddings the LM head is the embedding matrix itself (no copy).

The attention is a callable ``attend(q, k, v) -> (out, state)`` so the same layer code serves the
paged forward (this module: K/V go through ``ninfer_kv.ops.paged_append`` into layer ``l`` of the
Main pool and queries read them back through ``ninfer_kv.ops.paged_attention``) and the dense
reference (:mod:`ninfer_kv.models.decoder.dense`).

Ragged semantics (:func:`forward_ragged`): the tokens of ``R`` rows lie one after another
on one axis, row ``r`` owning ``[query_starts[r], query_starts[r + 1])`` at positions
``positions[r] + t`` (``ninfer_kv.ops.paged_attention_ragged``); the layers run on ``(1, N, d)`` so
every product sees all ``N`` tokens at once, and no row pays for another's length.

Paged chunk semantics (row ``b`` of a chunk of ``T`` tokens): token ``t`` sits at position
``positions[b] + t`` and is real iff ``t < valid[b]``.  Only real tokens are written; with
``kv_lens = positions + valid`` the ops' visibility rule ``j <= positions[b] + t and j < kv_lens[b]``
makes attention causal within the chunk.  Outputs at ``t >= valid[b]`` are finite but meaningless
and must be ignored by the caller; a row with ``valid[b] == 0`` writes nothing and, with
``positions[b] == 0``, sees no key at all (its attention output is zero).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ninfer_kv import ops
from ninfer_kv.ops.ragged import effective_starts, token_rows
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import PagedKVBatchLayerView

from .config import ModelConfig
from .layers import apply_rope, linear, linear_many, matmul_t, rms_norm, swiglu, token_positions

__all__ = [
    "Attend",
    "project_qkv",
    "decoder_layer",
    "paged_attend",
    "embed_tokens",
    "logits_from_hidden",
    "forward_paged",
    "ragged_attend",
    "forward_ragged",
]

Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]
"""``attend(q (B,T,Hq,D), k (B,T,H,D), v (B,T,H,D)) -> (out (B,T,Hq,D), state)``; k has RoPE applied."""


def embed_tokens(params: dict, tokens: jax.Array) -> jax.Array:
    """Token embeddings ``(B, T) -> (B, T, d_model)``; token IDs are clipped into the vocabulary."""
    emb = params["embed"]
    return jnp.take(emb, jnp.clip(tokens, 0, emb.shape[0] - 1), axis=0)


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array, final_norm: jax.Array | None = None):
    """float32 logits of hidden states ``(..., d_model) -> (..., vocab)`` (final RMSNorm + LM head)."""
    gain = params["final_norm"] if final_norm is None else final_norm
    x = rms_norm(hidden, gain, config.rms_eps)
    # (V, d): contract d, no copy; a tied head packed once (weights.pack_params) is params["lm_head"]
    head = params["lm_head"] if not config.tie_embeddings or "lm_head" in params else params["embed"]
    return matmul_t(x, head)


def project_qkv(lp: dict, config: ModelConfig, x: jax.Array, token_pos: jax.Array):
    """q ``(B,T,Hq,D)``, k, v ``(B,T,H,D)`` of normed input ``x``; q and k are (QK-normed and) rotated."""
    b, t, _ = x.shape
    c = config
    q, k, v = linear_many(x, (lp["wq"], lp["wk"], lp["wv"]), (lp.get("bq"), lp.get("bk"), lp.get("bv")))
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, lp["q_norm"], c.rms_eps)
        k = rms_norm(k, lp["k_norm"], c.rms_eps)
    q = apply_rope(q, token_pos, c.rope_theta, c.rope_scaling)
    k = apply_rope(k, token_pos, c.rope_theta, c.rope_scaling)
    return q, k, v


def decoder_layer(lp: dict, config: ModelConfig, h: jax.Array, token_pos: jax.Array, attend: Attend):
    """One pre-norm decoder layer on ``h (B, T, d_model)``; returns ``(h, attend's state)``."""
    b, t, _ = h.shape
    x = rms_norm(h, lp["attn_norm"], config.rms_eps)
    q, k, v = project_qkv(lp, config, x, token_pos)
    o, state = attend(q, k, v)
    h = h + linear(o.astype(h.dtype).reshape(b, t, config.num_heads * config.head_dim), lp["wo"], lp.get("bo"))
    x = rms_norm(h, lp["mlp_norm"], config.rms_eps)
    h = h + swiglu(x, lp["w_gate"], lp["w_up"], lp["w_down"], lp.get("b_gate"), lp.get("b_up"), lp.get("b_down"))
    return h, state


def paged_attend(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    impl: str,
) -> Attend:
    """Attention through the paged ops: append K/V at ``positions + t`` (t < valid), then attend.

    The returned state is the view holding the updated (aliased, donated) planes.
    """
    kv_lens = positions + valid

    def attend(q, k, v):
        new_view = ops.paged_append(view, table_rows, positions, k, v, valid, impl=impl)
        out = ops.paged_attention(q, new_view, table_rows, positions, kv_lens, impl=impl)
        return out, new_view

    return attend


def forward_paged(
    params: dict,
    config: ModelConfig,
    layout: PagedKVStorageLayout,
    planes: dict,
    block_tables: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    table_rows: jax.Array,
    *,
    impl: str,
) -> tuple[jax.Array, dict]:
    """Run all decoder layers on a chunk, appending its K/V to the Main pool.

    Args:
      params: :func:`ninfer_kv.models.decoder.weights.init_params` or
        :func:`ninfer_kv.models.hf.load_checkpoint` output.
      config: the model config; ``layout`` must be ``config.main_layout(profile)``.
      planes: the Main pool's stacked planes ``(num_layers, N, H, 64, X)`` (donated by the caller).
      block_tables: Main block tables ``int32 (C, L)``.
      tokens: int32 ``(B, T)``; positions, valid, table_rows: int32 ``(B,)``.
      impl: op implementation (see ``ninfer_kv.ops``).
    Returns:
      ``(hidden (B, T, d_model), planes)``: final hidden states before the final norm, and the
      updated planes.
    """
    positions = jnp.asarray(positions, jnp.int32)
    valid = jnp.asarray(valid, jnp.int32)
    table_rows = jnp.asarray(table_rows, jnp.int32)
    token_pos = token_positions(positions, tokens.shape[1])
    return _run_layers(params, config, layout, planes, block_tables, tokens, token_pos,
                       lambda view: paged_attend(view, table_rows, positions, valid, impl))


def _run_layers(params, config: ModelConfig, layout: PagedKVStorageLayout, planes: dict, block_tables, tokens,
                token_pos, attend_of: Callable[[PagedKVBatchLayerView], Attend]) -> tuple[jax.Array, dict]:
    """Every decoder layer over ``tokens`` at ``token_pos``, layer ``l`` attending through
    ``attend_of(its view of the Main pool)``; returns the final hidden states and the planes."""
    if layout.num_layers != config.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers, the model has {config.num_layers}")
    h = embed_tokens(params, tokens)
    for layer, lp in enumerate(params["layers"]):
        view = PagedKVBatchLayerView(planes, block_tables, layer, layout)
        h, view = decoder_layer(lp, config, h, token_pos, attend_of(view))
        planes = view.planes
    return h, planes


def ragged_attend(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    query_starts: jax.Array,
    kv_lens: jax.Array,
    impl: str,
) -> Attend:
    """:func:`paged_attend` of a ragged batch: ``q, k, v`` are ``(1, N, heads, D)``."""

    def attend(q, k, v):
        new_view = ops.paged_append_ragged(view, table_rows, positions, k[0], v[0], query_starts, impl=impl)
        out = ops.paged_attention_ragged(q[0], new_view, table_rows, positions, kv_lens, query_starts, impl=impl)
        return out[None], new_view

    return attend


def forward_ragged(
    params: dict,
    config: ModelConfig,
    layout: PagedKVStorageLayout,
    planes: dict,
    block_tables: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    query_starts: jax.Array,
    table_rows: jax.Array,
    *,
    impl: str,
) -> tuple[jax.Array, jax.Array, dict]:
    """Run all decoder layers on a ragged batch, appending every row's tokens to the Main pool.

    Args:
      tokens: int32 ``(N,)``; positions, table_rows: int32 ``(R,)``; query_starts: int32 ``(R + 1,)``
        (see the module docstring; padding tokens write nothing).
      Others as :func:`forward_paged`.
    Returns:
      ``(hidden (N, d_model), starts (R + 1,), planes)``: the final hidden states before the final
      norm, the effective row starts (:func:`~ninfer_kv.ops.ragged.effective_starts`: row ``r`` ran
      tokens ``[starts[r], starts[r + 1])``) and the updated planes.
    """
    n = tokens.shape[0]
    positions = jnp.asarray(positions, jnp.int32)
    query_starts = jnp.asarray(query_starts, jnp.int32)
    table_rows = jnp.asarray(table_rows, jnp.int32)
    tok = token_rows(table_rows, positions, query_starts, n)
    e = effective_starts(query_starts, n)
    kv_lens = positions + (e[1:] - e[:-1])
    h, planes = _run_layers(params, config, layout, planes, block_tables, tokens[None], tok.positions[None],
                            lambda view: ragged_attend(view, table_rows, positions, query_starts, kv_lens, impl))
    return h[0], e, planes
