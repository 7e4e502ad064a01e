"""The model behind the engine: a small protocol, and the Hugging Face decoder implementing it.

The engine owns the store, the device state and the scheduling; a model only runs steps.  A step
takes the caller's :class:`~ninfer_kv.KVDeviceState` (donated) and the round's
:class:`~ninfer_kv.schema.round_work.RoundWork`, applies the work first (:func:`~ninfer_kv.apply_work`), runs the
model over the batch through the paged ops of the Main pool, and returns the new state with the
token each row chooses::

    state, out = model.prefill(state, work, tokens, positions, valid, table_rows, sampling)
    state, out = model.decode(state, work, tokens, positions, valid, table_rows, sampling)

* ``tokens`` int32 ``(B, T)`` (``T = model.prefill_chunk`` for prefill, 1 for decode),
  ``positions``, ``valid``, ``table_rows`` int32 ``(B,)``: row ``b`` appends ``valid[b]`` tokens at
  sequence positions ``positions[b] ..`` into execution row ``table_rows[b]`` and attends to
  everything before them.  ``B`` is one of the engine's batch buckets; padding rows have
  ``valid == 0`` and write and read nothing (:mod:`ninfer_kv.models.decoder.padding`).
* ``sampling``: ``None`` (every row greedy) or a
  :class:`~ninfer_kv.models.decoder.sampling.SamplingRows` of ``(B,)`` rows; the token a row
  produces at sequence position ``positions + valid`` is drawn with its key folded with that
  position (:func:`~ninfer_kv.models.decoder.sampling.sample_tokens` does exactly this).
* the state arrives with the work-pending mark (docs/API.md): reading its planes or tables before
  ``state = apply_work(state, work)`` raises ``PendingWorkError`` when the step is traced;
* ``out.next_tokens`` int32 ``(B,)``: the token chosen after each row's last valid token (index
  ``max(valid - 1, 0)``: a padding row has ``valid == 0``; its outputs are ignored);
  ``out.logits`` float32 ``(B, V)`` there (read only when a request asks for log-probabilities).

Ragged rounds (optional).  A model with a ``ragged`` call runs a round's decodes and prefill
chunks as one ragged batch (``DecoderModel`` has it)::

    state, out = model.ragged(state, work, tokens, positions, query_starts, table_rows, sampling)

``tokens`` int32 ``(N,)`` holds the rows' tokens one after another, row ``r`` the tokens
``[query_starts[r], query_starts[r + 1])`` (``query_starts`` int32 ``(B + 1,)``) from position
``positions[r]``; ``N`` is a token bucket (``prepare``'s ``token_buckets``), padding rows own no
token; ``out`` is as for decode, at each row's last token.  The engine prepares such a model with
``prepare(layout, batch_buckets, token_buckets=...)``.  The engine feeds ragged rounds only to a model
that :func:`feeds_ragged_rounds` accepts: a ``ragged`` call, no speculation, and a
``runs_ragged_natively`` that is not ``False`` (:attr:`DecoderModel.runs_ragged_natively`: its ops
have native ragged kernels, so a prompt chunk's queries read each page once per query block and not
once per token); any other model gets rectangular prefill and decode units.

Speculative decoding (optional).  A model with an MTP head sets ``draft_window`` (``K``) and
``hidden_size`` (``d``), returns ``out.hidden`` float32 ``(B, T, d)`` (every position's main hidden
state) from prefill and decode, and has three more calls (:mod:`ninfer_kv.engine.speculative` says
what they compute)::

    state, drafts = model.mtp_draft(state, work, hidden, next_tokens, positions, valid, table_rows)
    state, _ = model.mtp_extend(state, work, hidden, next_tokens, positions, valid, table_rows)
    state, out = model.verify(state, work, tokens, positions, valid, table_rows, sampling)

``mtp_*`` read and write ``state.planes[PoolKind.MTP]`` (``hidden (B, T, d)``, ``next_tokens (B, T)``;
``drafts`` int32 ``(B, K)``); ``verify`` takes ``tokens (B, K + 1)`` and returns
:class:`VerifyOutput`.  The engine then plans the store with ``SpeculativeConfig("mtp", K)`` and
decodes in speculative rounds.

A model also says what it stores (:meth:`EngineModel.kv_config`: layers, KV heads, head dim of its
full-attention layers), its vocabulary and its prefill chunk.  :class:`DecoderModel` implements the
protocol over :class:`~ninfer_kv.models.decoder.steps.ModelSteps`; ``examples/engine_custom_model.py``
implements it for a model written in plain JAX.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ..device import KVDeviceState
from ..models.decoder.config import PREFILL_CHUNK, ModelConfig, StepConfig
from ..models.decoder.sampling import SamplingRows
from ..models.decoder.steps import ModelSteps, shared_steps
from ..ops.registry import resolve_impl
from ..planning import ModelKVConfig
from ..schema.layout import PagedKVStorageLayout
from ..schema.profiles import KVProfile
from ..schema.round_work import RoundWork

__all__ = ["StepOutput", "VerifyOutput", "EngineModel", "DecoderModel", "draft_window_of", "feeds_ragged_rounds"]


class StepOutput(NamedTuple):
    """What a model step returns besides the state: ``next_tokens`` int32 ``(B,)`` and ``logits``
    float32 ``(B, V)`` at each row's last valid token; ``hidden`` float32 ``(B, T, d)`` from a
    speculative model (``None`` otherwise)."""

    next_tokens: jax.Array
    logits: jax.Array
    hidden: jax.Array | None = None


class VerifyOutput(NamedTuple):
    """What a speculative model's ``verify`` returns besides the state: ``target_tokens`` int32
    ``(B, K + 1)`` (the token chosen after each input position), ``num_accepted`` int32 ``(B,)``
    (the longest prefix of drafts ``tokens[:, 1:]`` equal to the targets, among ``i < valid``),
    ``logits`` float32 ``(B, K + 1, V)`` and ``hidden`` float32 ``(B, K + 1, d)``."""

    target_tokens: jax.Array
    num_accepted: jax.Array
    logits: jax.Array
    hidden: jax.Array


def draft_window_of(model) -> int:
    """The draft window ``K`` of a speculative model, 0 for a plain one (``ValueError`` when it is
    not a positive int)."""
    k = getattr(model, "draft_window", 0) or 0
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"the model's draft_window={k!r} must be a positive int (or 0: no speculative decoding)")
    if k and not (isinstance(getattr(model, "hidden_size", None), int) and model.hidden_size > 0):
        raise ValueError("a speculative model (draft_window > 0) must say its hidden_size, a positive int")
    return k


def feeds_ragged_rounds(model) -> bool:
    """Whether the engine may feed ``model`` a round as one ragged unit (decodes beside prompt
    tokens) rather than as rectangular prefill and decode units: the model has a callable
    ``ragged``, is not speculative (:func:`draft_window_of` is 0), and does not say
    ``runs_ragged_natively = False``.  The engine's runner must also run ragged units
    (:attr:`~ninfer_kv.engine.runner.DeviceRunner.runs_ragged`; a data-parallel mesh runner does
    not).  ``TypeError`` when ``runs_ragged_natively`` is not a bool."""
    if not callable(getattr(model, "ragged", None)) or draft_window_of(model):
        return False
    native = getattr(model, "runs_ragged_natively", True)
    if not isinstance(native, bool):
        raise TypeError(f"the model's runs_ragged_natively={native!r} must be True or False")
    return native


@runtime_checkable
class EngineModel(Protocol):
    """A model the engine can serve (module docstring).

    Attributes:
      vocab_size: token ids are in ``[0, vocab_size)``.
      prefill_chunk: tokens per prefill call (``T`` of :meth:`prefill`), a multiple of 64.
    """

    vocab_size: int
    prefill_chunk: int

    def kv_config(self, profile: KVProfile) -> ModelKVConfig:
        """The KV shape of the model's full-attention layers, stored in ``profile``."""

    def prepare(self, layout: PagedKVStorageLayout, batch_buckets: tuple[int, ...]) -> None:
        """Receive the Main pool's layout (profile, layers, KV heads, head dim: what
        ``kv_config(profile)`` planned) and the batch sizes the steps will be called with, before
        any step; the steps read ``state.planes[PoolKind.MAIN]`` and ``state.tables[PoolKind.MAIN]``."""

    def prefill(self, state: KVDeviceState, work: RoundWork, tokens, positions, valid, table_rows,
                sampling: SamplingRows | None = None) -> tuple[KVDeviceState, StepOutput]:
        """One chunk of prefill for every row (module docstring)."""

    def decode(self, state: KVDeviceState, work: RoundWork, tokens, positions, valid, table_rows,
               sampling: SamplingRows | None = None) -> tuple[KVDeviceState, StepOutput]:
        """One token of decode for every row (module docstring)."""


class DecoderModel:
    """The package's decoder (:mod:`ninfer_kv.models.decoder`, the Hugging Face families) as an
    :class:`EngineModel`.

    Args:
      params: the parameter tree (``load_checkpoint(...).params`` or ``init_params``).
      config: its :class:`~ninfer_kv.models.decoder.config.ModelConfig`.
      impl: op implementation, one of :func:`ninfer_kv.ops.registry.impl_choices` (``"auto"``: FFI on CPU,
        Pallas on GPU, Mosaic on TPU).
      prefill_chunk: tokens per prefill call (a multiple of 64).
      draft_window: with a config that has an MTP head (``ModelConfig(mtp=True)``), decode in
        speculative rounds of ``K`` drafts (0: plain decoding).
      mesh: a :class:`~ninfer_kv.device.mesh.KVMesh` to run the steps on a sharded state (main model only;
        :class:`~ninfer_kv.engine.data_parallel.DataParallelEngine`), or ``None``.

    The engine feeds it ragged rounds only when :attr:`runs_ragged_natively` (its ``impl`` has
    native ragged kernels); otherwise rectangular prefill and decode units.
    """

    def __init__(self, params: dict, config: ModelConfig, *, impl: str = "auto", prefill_chunk: int = PREFILL_CHUNK,
                 draft_window: int = 0, mesh=None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if draft_window and not config.mtp:
            raise ValueError(f"draft_window={draft_window} needs a model with an MTP head (ModelConfig(mtp=True))")
        if draft_window and mesh is not None:
            raise ValueError("speculative decoding runs on one device; a mesh serves the main model only")
        if draft_window or mesh is not None:  # meshes and speculation keep every layer in the Main pool
            config = dataclasses.replace(config, window_rings=False)
        StepConfig(model=config, impl=impl, prefill_chunk=prefill_chunk,
                   draft_window=max(1, int(draft_window)))  # validates impl, chunk and K
        self.params = params
        self.config = config
        self.impl = impl
        self.prefill_chunk = int(prefill_chunk)
        self.vocab_size = config.vocab_size
        self.draft_window = int(draft_window)
        self.hidden_size = config.d_model
        self.mesh = mesh
        self._steps = None

    def kv_config(self, profile: KVProfile) -> ModelKVConfig:
        """The decoder's KV shape in ``profile``."""
        return self.config.kv_config(KVProfile.parse(profile))

    def prepare(self, layout: PagedKVStorageLayout, batch_buckets: tuple[int, ...],
                token_buckets: tuple[int, ...] | None = None) -> None:
        """Build (or reuse: steps are shared per configuration) the jitted steps for ``layout``'s
        profile (on a mesh, ``layout`` is one device's and the buckets are global); ``token_buckets``
        are the ragged step's token counts (default: the step configuration's)."""
        if self.mesh is None and layout != self.config.main_layout(layout.profile):
            raise ValueError(f"the store's Main layout {layout} is not this decoder's "
                             f"{self.config.main_layout(layout.profile)}")
        step_config = StepConfig(model=self.config, profile=layout.profile, impl=self.impl,
                                 prefill_chunk=self.prefill_chunk, batch_buckets=tuple(batch_buckets),
                                 draft_window=max(1, self.draft_window),
                                 **({"token_buckets": tuple(token_buckets)} if token_buckets else {}))
        if self.mesh is None:
            self._steps = shared_steps(step_config)
            self.params = self._steps.prepare_params(self.params)
        else:
            from ..models.decoder.mesh_steps import MeshSteps

            self._steps = MeshSteps(step_config, self.mesh, layout)

    @property
    def runs_ragged_natively(self) -> bool:
        """Whether :meth:`ragged` runs on native ragged kernels, so the engine feeds this model
        ragged rounds (:func:`feeds_ragged_rounds`).

        True when the model runs on one device (a mesh has no ragged step) and the implementation
        its steps use — ``impl``, or for ``"auto"`` what :func:`~ninfer_kv.ops.registry.resolve_impl`
        picks on the current default backend — has both ``paged_append_ragged`` and
        ``paged_attention_ragged``.  A backend without them (``None`` in its
        :class:`~ninfer_kv.ops.registry.OpImpl`) would run a ragged round one query per row
        (:mod:`ninfer_kv.ops.ragged`), reading a row's keys once per prompt token; the engine then
        runs rectangular prefill and decode units instead.  Resolved on each read (``impl`` must
        load here: :class:`~ninfer_kv.ops.registry.ImplUnavailableError` otherwise).
        """
        if self.mesh is not None:
            return False
        ops = resolve_impl(self.impl)
        return ops.paged_append_ragged is not None and ops.paged_attention_ragged is not None

    @property
    def steps(self) -> ModelSteps:
        """The jitted steps (after :meth:`prepare`)."""
        if self._steps is None:
            raise RuntimeError("DecoderModel.prepare(layout, batch_buckets) must run before any step")
        return self._steps

    def _run(self, name, state, work, *args, sampling=None):
        if sampling is not None:
            args = args + (sampling,)
        return self.steps.on_state(name)(self.params, state, work, *args)

    def prefill(self, state, work, tokens, positions, valid, table_rows, sampling=None):
        """One prefill chunk per row through the decoder's jitted state step."""
        state, out = self._run("prefill", state, work, tokens, positions, valid, table_rows, sampling=sampling)
        return state, StepOutput(out.next_tokens, out.logits, out.hidden if self.draft_window else None)

    def decode(self, state, work, tokens, positions, valid, table_rows, sampling=None):
        """One decode token per row through the decoder's jitted state step."""
        state, out = self._run("decode", state, work, tokens, positions, valid, table_rows, sampling=sampling)
        return state, StepOutput(out.next_tokens, out.logits, out.hidden if self.draft_window else None)

    def verify(self, state, work, tokens, positions, valid, table_rows, sampling=None):
        """Verify ``K`` drafts per row (speculative decoding)."""
        state, out = self._run("verify", state, work, tokens, positions, valid, table_rows, sampling=sampling)
        return state, VerifyOutput(out.target_tokens, out.num_accepted, out.logits, out.hidden)

    def ragged(self, state, work, tokens, positions, query_starts, table_rows, sampling=None):
        """One ragged batch through the decoder's jitted ragged step: row ``r`` feeds tokens
        ``[query_starts[r], query_starts[r + 1])`` (a decode's one token or a prefill chunk)."""
        state, out = self._run("ragged", state, work, tokens, positions, query_starts, table_rows, sampling=sampling)
        return state, StepOutput(out.next_tokens, out.logits, None)

    def mtp_extend(self, state, work, hidden, next_tokens, positions, valid, table_rows):
        """Write MTP pairs (speculative decoding)."""
        hidden = jnp.asarray(hidden, self.config.jnp_dtype)
        state, _ = self._run("mtp_extend", state, work, hidden, next_tokens, positions, valid, table_rows)
        return state, None

    def mtp_draft(self, state, work, hidden, next_tokens, positions, valid, table_rows):
        """Extend the pending MTP pairs and draft ``K`` tokens per row (speculative decoding)."""
        hidden = jnp.asarray(hidden, self.config.jnp_dtype)
        state, out = self._run("mtp_draft", state, work, hidden, next_tokens, positions, valid, table_rows)
        return state, out.drafts
