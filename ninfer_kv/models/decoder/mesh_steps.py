"""Jitted state steps of the example decoder over a KV cache sharded on a ``data x model`` mesh.

The steps take a sharded :class:`~ninfer_kv.KVDeviceState` (``allocate_state(sharded_store)``)
and a :class:`~ninfer_kv.store.sharded.ShardedRoundWork` padded to one shape
(``ShardedKVStore.take_step_work``)::

    prefill_state(params, state, work, tokens (B, chunk), positions, valid, table_rows[, sampling]) -> (state, PrefillOutput)
    decode_state(params, state, work, tokens (B, 1), positions, valid, table_rows[, sampling])     -> (state, DecodeOutput)

with ``B = D * B_local``: batch slots ``[d * B_local, (d + 1) * B_local)`` carry global rows of data
shard ``d`` (``d * C_local + local row``) or the inert row ``C``.  Every step first applies the work
per shard (:func:`~ninfer_kv.device.sharded_ops.sharded_apply_work`), then runs the decoder: embeddings,
norms, the q/k/v and output projections and the MLP are replicated; each layer's paged append and
paged attention run per device inside ``shard_map``
(:func:`~ninfer_kv.device.sharded_ops.sharded_paged_append`,
:func:`~ninfer_kv.device.sharded_ops.sharded_paged_attention`): a device writes and reads only its
data shard's pages and its model shard's KV heads.  The attention outputs are gathered over the
model axis for the output projection; the planes never leave their devices.  The outputs are the
single-device steps' (planes and tables ``None``); with ``sampling`` (a
:class:`~ninfer_kv.models.decoder.sampling.SamplingRows` of ``(B,)`` rows, replicated) tokens are
sampled exactly as the single-device steps sample them, else chosen greedily.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...device.mesh import KVMesh
from ...device.sharded_ops import sharded_apply_work, sharded_paged_append, sharded_paged_attention
from ...schema.kinds import PoolKind
from ...device.state import KVDeviceState
from .config import StepConfig
from .model import decoder_layer, embed_tokens, logits_from_hidden
from .layers import token_positions
from .steps import STATE_DONATED_ARGNUMS, CountedStep, DecodeOutput, PrefillOutput, _at_index, _choose, _token_check

__all__ = ["MeshSteps", "forward_paged_mesh"]

MAIN = PoolKind.MAIN


def forward_paged_mesh(params: dict, config, kv_mesh: KVMesh, layout, state: KVDeviceState, tokens: jax.Array,
                       positions: jax.Array, valid: jax.Array, table_rows: jax.Array, *, impl: str):
    """All decoder layers on a chunk over a sharded state (each with its
    :meth:`~ninfer_kv.models.decoder.config.ModelConfig.attention_options`); returns
    ``(hidden (B, T, d), state)``.

    ``layout`` is the per-device Main layout (``ShardedKVStore.layout("main")``)."""
    positions = jnp.asarray(positions, jnp.int32)
    valid = jnp.asarray(valid, jnp.int32)
    table_rows = jnp.asarray(table_rows, jnp.int32)
    kv_lens = positions + valid
    token_pos = token_positions(positions, tokens.shape[1])
    h = embed_tokens(params, tokens, config)
    for layer, lp in enumerate(params["layers"]):

        def attend(q, k, v, layer=layer, st=state):
            st = sharded_paged_append(kv_mesh, st, layer, layout, table_rows, positions, k, v, valid,
                                      pool=MAIN, impl=impl)
            out = sharded_paged_attention(kv_mesh, q, st, layer, layout, table_rows, positions, kv_lens,
                                          pool=MAIN, impl=impl, **config.attention_options(layer))
            return out, st

        h, state = decoder_layer(lp, config, h, token_pos, attend, layer)
    return h, state


class MeshSteps:
    """Prefill and decode state steps for one :class:`StepConfig` on a :class:`KVMesh`.

    Args:
      step_config: model, profile, impl and the *global* batch buckets (``D * B_local``).
      kv_mesh: the mesh of the state.
      layout: the per-device Main layout.
    """

    def __init__(self, step_config: StepConfig, kv_mesh: KVMesh, layout):
        if not isinstance(step_config, StepConfig):
            raise TypeError(f"step_config must be a StepConfig, got {type(step_config).__name__}")
        if step_config.model.mtp:
            raise ValueError("MeshSteps runs the main model only; the MTP head is not supported on a mesh")
        bad = [b for b in step_config.batch_buckets if b % kv_mesh.data]
        if bad:
            raise ValueError(f"batch buckets {bad} do not split over the data axis of size {kv_mesh.data}")
        self.config = cfg = step_config
        self.kv_mesh = kv_mesh
        model, impl = cfg.model, cfg.impl

        def run(params, state, tokens, positions, valid, table_rows):
            return forward_paged_mesh(params, model, kv_mesh, layout, state, tokens, positions, valid, table_rows,
                                      impl=impl)

        def produced(positions, valid):
            return jnp.asarray(positions, jnp.int32) + jnp.asarray(valid, jnp.int32)

        def prefill(params, state, work, tokens, positions, valid, table_rows, sampling=None):
            state = sharded_apply_work(kv_mesh, state, work)
            hidden, state = run(params, state, tokens, positions, valid, table_rows)
            logits = logits_from_hidden(params, model, _at_index(hidden, jnp.maximum(valid - 1, 0)))
            chosen = _choose(logits, sampling, produced(positions, valid))
            return state, PrefillOutput(None, None, logits, chosen, hidden)

        def decode(params, state, work, tokens, positions, valid, table_rows, sampling=None):
            state = sharded_apply_work(kv_mesh, state, work)
            hidden, state = run(params, state, tokens, positions, valid, table_rows)
            logits = logits_from_hidden(params, model, hidden[:, 0])
            return state, DecodeOutput(None, None, logits, _choose(logits, sampling, produced(positions, valid)), hidden)

        def checked(name, t):
            check = _token_check(cfg, name, t)

            def check_arguments(params, state, work, *args):
                if not isinstance(state, KVDeviceState):
                    raise TypeError(f"{name}: state must be a KVDeviceState, got {type(state).__name__}")
                shaped = state.replace(work_pending=False)  # shapes and dtypes: the same before and after the work
                check(params, shaped.pool_planes(MAIN), shaped.table(MAIN), *args)

            return check_arguments

        self._state_steps = {
            "prefill": CountedStep("prefill_state", prefill, checked("prefill", cfg.prefill_chunk),
                                   donate_argnums=STATE_DONATED_ARGNUMS),
            "decode": CountedStep("decode_state", decode, checked("decode", 1), donate_argnums=STATE_DONATED_ARGNUMS),
        }

    def on_state(self, name: str) -> CountedStep:
        """The state step ``name`` (``prefill`` or ``decode``)."""
        try:
            return self._state_steps[name]
        except KeyError:
            raise ValueError(f"unknown mesh step {name!r}; steps: {sorted(self._state_steps)}") from None

    def compiles(self) -> dict[str, int]:
        """Backend compilations per step function."""
        return {f"{name}_state": s.compiles for name, s in self._state_steps.items()}
