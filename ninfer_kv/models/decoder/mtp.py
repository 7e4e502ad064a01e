"""Multi-token-prediction (MTP) head: one extra decoder layer with its own KV pool.

At position ``i`` the head combines the main model's final hidden state ``h_i`` (before the final
norm) with the embedding of the next token ``t_{i+1}`` and predicts ``t_{i+2}``::

    x_i = concat(rms_norm(embed(t_{i+1}), enorm), rms_norm(h_i, hnorm)) @ proj
    g_i = decoder_layer(x_i)              # K/V of position i go to the MTP pool (layer 0)
    logits_i = lm_head(rms_norm(g_i, mtp.final_norm))

The embedding and the LM head are shared with the main model.  The MTP layer is a full-attention
layer with the global RoPE (``layer=None`` of :meth:`~ninfer_kv.models.decoder.config.ModelConfig.attention_options`
and :meth:`~ninfer_kv.models.decoder.config.ModelConfig.layer_rope`); its norms follow ``gemma_norms``.  The MTP pool is a second
:class:`~ninfer_kv.schema.layout.PagedKVStorageLayout` with one layer and Main's profile and geometry.

Drafting ``K`` tokens (:func:`mtp_draft_paged`): an *extend* over a chunk of known
``(h_i, t_{i+1})`` pairs ending at the row's last valid position ``q`` yields the first draft
``d_1`` (the token at ``q + 2``) and the MTP hidden ``g_q``; each further step ``k = 1 .. K-1``
feeds ``(g_{q+k-1}, d_k)`` at position ``q + k`` and yields ``d_{k+1}``.  The MTP pool therefore
holds positions up to ``q + K - 1`` while Main is committed through ``q``: a provisional lead of
``K - 1`` tokens, which the MTP pool's extra ``C * ceil((K - 1) / 64)`` pages cover.  The next
round's extend overwrites the provisional positions with the target's hidden states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.views import PagedKVBatchLayerView

from .config import ModelConfig
from .layers import token_positions
from .model import Attend, decoder_layer, embed_tokens, logits_from_hidden, norm, paged_attend

__all__ = ["mtp_input", "mtp_layer", "mtp_forward_paged", "mtp_draft_paged"]


def _mtp_params(params: dict) -> dict:
    if "mtp" not in params:
        raise ValueError("params have no 'mtp' entry; build them with ModelConfig(mtp=True)")
    return params["mtp"]


def mtp_input(params: dict, config: ModelConfig, hidden: jax.Array, next_tokens: jax.Array) -> jax.Array:
    """The MTP layer's input ``(B, T, d_model)`` from main hidden ``(B, T, d)`` and next tokens ``(B, T)``."""
    mp = _mtp_params(params)
    e = norm(embed_tokens(params, next_tokens, config), mp["enorm"], config)
    h = norm(hidden.astype(e.dtype), mp["hnorm"], config)
    return jnp.concatenate([e, h], axis=-1) @ mp["proj"]


def mtp_layer(params: dict, config: ModelConfig, hidden, next_tokens, token_pos, attend: Attend):
    """MTP hidden ``g (B, T, d)``, float32 logits ``(B, T, V)`` and the attend state."""
    mp = _mtp_params(params)
    x = mtp_input(params, config, hidden, next_tokens)
    g, state = decoder_layer(mp["layer"], config, x, token_pos, attend)
    return g, logits_from_hidden(params, config, g, final_norm=mp["final_norm"]), state


def mtp_forward_paged(
    params: dict,
    config: ModelConfig,
    layout: PagedKVStorageLayout,
    planes: dict,
    block_tables: jax.Array,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    table_rows: jax.Array,
    *,
    impl: str,
):
    """MTP over a chunk: pair ``t`` of row ``b`` sits at ``positions[b] + t`` and is real iff ``t < valid[b]``.

    Returns ``(g (B, T, d), logits (B, T, V) float32, planes)``; the K/V of real pairs are written
    to layer 0 of the MTP pool.
    """
    if layout.num_layers != 1:
        raise ValueError(f"the MTP pool has exactly one layer; got a layout with {layout.num_layers}")
    positions = jnp.asarray(positions, jnp.int32)
    valid = jnp.asarray(valid, jnp.int32)
    table_rows = jnp.asarray(table_rows, jnp.int32)
    view = PagedKVBatchLayerView(planes, block_tables, 0, layout)
    token_pos = token_positions(positions, hidden.shape[1])
    g, logits, view = mtp_layer(
        params, config, hidden, next_tokens, token_pos,
        paged_attend(view, table_rows, positions, valid, impl, config.attention_options(None))
    )
    return g, logits, view.planes


def _at_last_valid(x: jax.Array, valid: jax.Array) -> jax.Array:
    """``x[b, max(valid[b] - 1, 0)]`` for ``x (B, T, ...)``."""
    idx = jnp.maximum(valid - 1, 0)
    return jax.vmap(lambda row, i: row[i])(x, idx)


def mtp_draft_paged(
    params: dict,
    config: ModelConfig,
    layout: PagedKVStorageLayout,
    planes: dict,
    block_tables: jax.Array,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    table_rows: jax.Array,
    *,
    num_drafts: int,
    impl: str,
):
    """Extend the MTP pool over a chunk, then draft ``num_drafts`` greedy tokens per row.

    Returns ``(drafts int32 (B, K), draft_logits float32 (B, K, V), planes)``; ``drafts[b, k]`` is
    the guess for the token at ``q_b + 2 + k`` with ``q_b = positions[b] + valid[b] - 1``.  Rows
    with ``valid[b] == 0`` write nothing in any step and, placed at position 0 in the recursive
    steps, see no key; their drafts are meaningless.
    """
    positions = jnp.asarray(positions, jnp.int32)
    valid = jnp.asarray(valid, jnp.int32)
    g, logits, planes = mtp_forward_paged(
        params, config, layout, planes, block_tables, hidden, next_tokens, positions, valid, table_rows, impl=impl
    )
    g = _at_last_valid(g, valid)[:, None, :]  # (B, 1, d)
    step_logits = _at_last_valid(logits, valid)  # (B, V)
    last = positions + valid - 1
    live = (valid > 0).astype(jnp.int32)
    all_logits = [step_logits]
    for k in range(1, num_drafts):
        draft = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
        g, step_logits, planes = mtp_forward_paged(
            params, config, layout, planes, block_tables, g, draft[:, None], jnp.where(live > 0, last + k, 0),
            live, table_rows, impl=impl,
        )
        step_logits = step_logits[:, 0]
        all_logits.append(step_logits)
    draft_logits = jnp.stack(all_logits, axis=1)
    return jnp.argmax(draft_logits, axis=-1).astype(jnp.int32), draft_logits, planes
