"""The decoder's forward pass over the paged KV cache.

One decoder layer ``l`` (pre-norm; bracketed parts are :class:`~ninfer_kv.models.decoder.config.ModelConfig`
options)::

    x = rms_norm(h, attn_norm)
    q = rope_l([q_norm](x @ wq [+ bq])), k = rope_l([k_norm](x @ wk [+ bk])), v = x @ wv [+ bv]   (per head)
    a = attention_l(q, k, v) @ wo [+ bo]
    h = h + [rms_norm](a, post_attn_norm)             (sandwich_norms)
    m = mlp(rms_norm(h, mlp_norm))                     (SwiGLU or GeGLU; [b_gate], [b_up], [b_down])
    h = h + [rms_norm](m, post_mlp_norm)              (sandwich_norms)

``rope_l`` is :meth:`~ninfer_kv.models.decoder.config.ModelConfig.layer_rope` (the sliding layers
may have their own base and scaling) and ``attention_l`` runs with
:meth:`~ninfer_kv.models.decoder.config.ModelConfig.attention_options` (the layer's window, the
attention soft cap, the query scale); every RMSNorm is Gemma's ``(1 + w)`` form with ``gemma_norms``.
The embeddings are multiplied by ``sqrt(d_model)`` with ``embed_scale``.

Projections are ``(out, in)`` matrices (``nn.Linear`` weights) contracted over ``in`` with float32
accumulation.  Logits are float32: ``rms_norm(h, final_norm)`` contracted with the LM head ``(V, d)``
(with ``final_soft_cap`` ``c``: ``c * tanh(logits / c)``); with tied embeddings the LM head is the
embedding matrix itself (no copy).

The attention is a callable ``attend(q, k, v) -> (out, state)`` so the same layer code serves the
paged forward (this module: K/V go through ``ninfer_kv.ops.paged_append`` into layer ``l`` of the
Main pool and queries read them back through ``ninfer_kv.ops.paged_attention`` with the layer's
options) and the dense reference (:mod:`ninfer_kv.models.decoder.dense`).  A layer with a window
keeps its K/V in the window rings when the config has :attr:`~ModelConfig.ring_layers` (each
execution row's ring holds its window, :mod:`ninfer_kv.planning.rings`), else in the Main pool
like every other layer; either way its attention reads only the pages its window sees.

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

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv import ops
from ninfer_kv.ops.ragged import effective_starts, token_rows
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import PagedKVBatchLayerView, ring_table

from .config import ModelConfig
from .layers import apply_rope, gated_mlp, linear, linear_many, matmul_t, rms_norm, token_positions

__all__ = [
    "Attend",
    "project_qkv",
    "decoder_layer",
    "norm",
    "paged_attend",
    "embed_tokens",
    "logits_from_hidden",
    "forward_paged",
    "ragged_attend",
    "forward_ragged",
]

Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]
"""``attend(q (B,T,Hq,D), k (B,T,H,D), v (B,T,H,D)) -> (out (B,T,Hq,D), state)``; k has RoPE applied."""


def embed_tokens(params: dict, tokens: jax.Array, config: ModelConfig | None = None) -> jax.Array:
    """Token embeddings ``(B, T) -> (B, T, d_model)``; token IDs are clipped into the vocabulary.

    With ``config.embed_scale`` they are multiplied by ``sqrt(d_model)`` rounded to float32 and then
    to the embedding dtype (transformers' Gemma normalizer), the product rounded to that dtype."""
    emb = params["embed"]
    x = jnp.take(emb, jnp.clip(tokens, 0, emb.shape[0] - 1), axis=0)
    if config is not None and config.embed_scale:
        x = x * jnp.asarray(np.float32(math.sqrt(config.d_model))).astype(x.dtype)
    return x


def norm(x: jax.Array, gain: jax.Array, config: ModelConfig) -> jax.Array:
    """The config's RMSNorm of ``x`` with ``gain`` (Gemma's ``(1 + w)`` form with ``gemma_norms``)."""
    return rms_norm(x, gain, config.rms_eps, offset=config.gemma_norms)


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array, final_norm: jax.Array | None = None):
    """float32 logits of hidden states ``(..., d_model) -> (..., vocab)`` (final RMSNorm + LM head,
    then ``c * tanh(logits / c)`` with ``config.final_soft_cap`` ``c``)."""
    gain = params["final_norm"] if final_norm is None else final_norm
    x = norm(hidden, gain, config)
    # (V, d): contract d, no copy; a tied head packed once (weights.pack_params) is params["lm_head"]
    head = params["lm_head"] if not config.tie_embeddings or "lm_head" in params else params["embed"]
    logits = matmul_t(x, head)
    if config.final_soft_cap is not None:
        cap = jnp.float32(config.final_soft_cap)
        logits = cap * jnp.tanh(logits / cap)
    return logits


def project_qkv(lp: dict, config: ModelConfig, x: jax.Array, token_pos: jax.Array, layer: int | None = None):
    """q ``(B,T,Hq,D)``, k, v ``(B,T,H,D)`` of normed input ``x``; q and k are (QK-normed and) rotated
    with decoder layer ``layer``'s RoPE (:meth:`ModelConfig.layer_rope`; ``None``: the global one)."""
    b, t, _ = x.shape
    c = config
    q, k, v = linear_many(x, (lp["wq"], lp["wk"], lp["wv"]), (lp.get("bq"), lp.get("bk"), lp.get("bv")))
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = norm(q, lp["q_norm"], c)
        k = norm(k, lp["k_norm"], c)
    theta, scaling = c.layer_rope(layer)
    q = apply_rope(q, token_pos, theta, scaling)
    k = apply_rope(k, token_pos, theta, scaling)
    return q, k, v


def decoder_layer(lp: dict, config: ModelConfig, h: jax.Array, token_pos: jax.Array, attend: Attend,
                  layer: int | None = None):
    """Decoder layer ``layer`` (its RoPE; ``None``: a layer outside the stack, the MTP head's) on
    ``h (B, T, d_model)``; returns ``(h, attend's state)``.  ``attend`` must apply the layer's
    :meth:`ModelConfig.attention_options`."""
    b, t, _ = h.shape
    c = config
    x = norm(h, lp["attn_norm"], c)
    q, k, v = project_qkv(lp, c, x, token_pos, layer)
    o, state = attend(q, k, v)
    a = linear(o.astype(h.dtype).reshape(b, t, c.num_heads * c.head_dim), lp["wo"], lp.get("bo"))
    if c.sandwich_norms:
        a = norm(a, lp["post_attn_norm"], c)
    h = h + a
    x = norm(h, lp["mlp_norm"], c)
    m = gated_mlp(x, lp["w_gate"], lp["w_up"], lp["w_down"], lp.get("b_gate"), lp.get("b_up"), lp.get("b_down"),
                  activation=c.mlp_activation)
    if c.sandwich_norms:
        m = norm(m, lp["post_mlp_norm"], c)
    return h + m, state


def paged_attend(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    impl: str,
    options: dict | None = None,
) -> Attend:
    """Attention through the paged ops: append K/V at ``positions + t`` (t < valid), then attend
    with ``options`` (:meth:`ModelConfig.attention_options` of the layer: ``window``,
    ``soft_cap``, ``sm_scale``; ``None``: full attention at the default scale).

    The returned state is the view holding the updated (aliased, donated) planes.
    """
    kv_lens = positions + valid
    options = dict(options or {})

    def attend(q, k, v):
        new_view = ops.paged_append(view, table_rows, positions, k, v, valid, impl=impl)
        out = ops.paged_attention(q, new_view, table_rows, positions, kv_lens, impl=impl, **options)
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
    rings: dict | None = None,
) -> tuple[jax.Array, dict, dict | None]:
    """Run all decoder layers on a chunk, appending its K/V to the Main pool (and the window rings).

    Args:
      params: :func:`ninfer_kv.models.decoder.weights.init_params` or
        :func:`ninfer_kv.models.hf.load_checkpoint` output.
      config: the model config; ``layout`` must be ``config.main_layout(profile)``.
      planes: the Main pool's stacked planes ``(num_layers, N, H, 64, X)`` (donated by the caller).
      block_tables: Main block tables ``int32 (C, L)``.
      tokens: int32 ``(B, T)``; positions, valid, table_rows: int32 ``(B,)``.
      impl: op implementation (see ``ninfer_kv.ops``).
      rings: the window rings' planes (``KVDeviceState.rings``) of a model with
        :attr:`~ModelConfig.ring_layers` (donated with the planes), else ``None``.
    Returns:
      ``(hidden (B, T, d_model), planes, rings)``: final hidden states before the final norm, and the
      updated planes and rings (``None`` without).
    """
    positions = jnp.asarray(positions, jnp.int32)
    valid = jnp.asarray(valid, jnp.int32)
    table_rows = jnp.asarray(table_rows, jnp.int32)
    token_pos = token_positions(positions, tokens.shape[1])
    return _run_layers(params, config, layout, planes, block_tables, tokens, token_pos,
                       lambda view, layer: paged_attend(view, table_rows, positions, valid, impl,
                                                        config.attention_options(layer)), rings)


def _run_layers(params, config: ModelConfig, layout: PagedKVStorageLayout, planes: dict, block_tables, tokens,
                token_pos, attend_of: Callable[[PagedKVBatchLayerView, int], Attend],
                rings: dict | None) -> tuple[jax.Array, dict, dict | None]:
    """Every decoder layer over ``tokens`` at ``token_pos``, layer ``l`` attending through
    ``attend_of(its view, l)`` (which applies ``config.attention_options(l)``): a view of the Main
    pool, or of the window rings for the :attr:`~ModelConfig.ring_layers` (their table derived from
    Main's, :func:`~ninfer_kv.ops.views.ring_table`); returns the final hidden states, the planes
    and the rings."""
    main_layers = config.num_layers - len(config.ring_layers)
    if layout.num_layers != main_layers:
        raise ValueError(f"layout has {layout.num_layers} layers, the model keeps {main_layers} in the Main pool")
    spec = config.kv_config(layout.profile).rings
    if (spec is None) != (rings is None):
        raise ValueError("this model keeps its windowed layers in window rings: run it on a KVDeviceState planned "
                         "from its kv_config (state.rings)" if rings is None else
                         "rings were given but the model keeps every layer in the Main pool")
    ring_tables = None if spec is None else ring_table(block_tables, spec.pages_per_row)
    ring_layout = None if spec is None else spec.layout(layout.profile, layout.num_kv_heads, layout.head_dim)
    h = embed_tokens(params, tokens, config)
    for layer, lp in enumerate(params["layers"]):
        in_ring, index = config.kv_slot(layer)
        if in_ring:
            view = PagedKVBatchLayerView(rings, ring_tables, index, ring_layout)
        else:
            view = PagedKVBatchLayerView(planes, block_tables, index, layout)
        h, view = decoder_layer(lp, config, h, token_pos, attend_of(view, layer), layer)
        if in_ring:
            rings = view.planes
        else:
            planes = view.planes
    return h, planes, rings


def ragged_attend(
    view: PagedKVBatchLayerView,
    table_rows: jax.Array,
    positions: jax.Array,
    query_starts: jax.Array,
    kv_lens: jax.Array,
    impl: str,
    options: dict | None = None,
) -> Attend:
    """:func:`paged_attend` of a ragged batch: ``q, k, v`` are ``(1, N, heads, D)``; ``options`` as there."""
    options = dict(options or {})

    def attend(q, k, v):
        new_view = ops.paged_append_ragged(view, table_rows, positions, k[0], v[0], query_starts, impl=impl)
        out = ops.paged_attention_ragged(q[0], new_view, table_rows, positions, kv_lens, query_starts, impl=impl,
                                         **options)
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
    rings: dict | None = None,
) -> tuple[jax.Array, jax.Array, dict, dict | None]:
    """Run all decoder layers on a ragged batch, appending every row's tokens to the Main pool
    (and the window rings).

    Args:
      tokens: int32 ``(N,)``; positions, table_rows: int32 ``(R,)``; query_starts: int32 ``(R + 1,)``
        (see the module docstring; padding tokens write nothing).
      Others as :func:`forward_paged`.
    Returns:
      ``(hidden (N, d_model), starts (R + 1,), planes, rings)``: the final hidden states before the
      final norm, the effective row starts (:func:`~ninfer_kv.ops.ragged.effective_starts`: row ``r``
      ran tokens ``[starts[r], starts[r + 1])``), the updated planes and rings (``None`` without).
    """
    n = tokens.shape[0]
    positions = jnp.asarray(positions, jnp.int32)
    query_starts = jnp.asarray(query_starts, jnp.int32)
    table_rows = jnp.asarray(table_rows, jnp.int32)
    tok = token_rows(table_rows, positions, query_starts, n)
    e = effective_starts(query_starts, n)
    kv_lens = positions + (e[1:] - e[:-1])
    h, planes, rings = _run_layers(params, config, layout, planes, block_tables, tokens[None], tok.positions[None],
                                   lambda view, layer: ragged_attend(view, table_rows, positions, query_starts,
                                                                     kv_lens, impl, config.attention_options(layer)),
                                   rings)
    return h[0], e, planes, rings
