"""Jitted step functions of the decoder over the paged KV cache.

Every step is a ``jax.jit`` of a fixed positional signature whose arguments 1 and 2 — the pool's
stacked ``planes`` and its block-table matrix ``block_tables int32 (C, L)`` — are **donated**; the
step returns both (the planes updated in place by the ops, the tables passed through, aliased to
their input buffers).  The caller must not touch a donated array again: use the returned planes for
the next step and publish fresh block tables per step.

Graph keys: everything that varies per step — token IDs, positions, valid counts, table rows, page
IDs in the tables, the layer index — is int32 array *data*.  The static part is only the
:class:`~ninfer_kv.models.decoder.config.StepConfig` (closed over, fixed per :class:`ModelSteps`) and the
input shapes: the batch bucket ``B`` and the chunk length (``prefill_chunk`` for prefill, 1 for
decode, ``K + 1`` for verify).  So each step compiles once per (bucket, chunk length, pool size).

Steps (``B`` in ``step_config.batch_buckets``; pad with :func:`ninfer_kv.models.decoder.padding.pad_rows`)::

    prefill(params, planes, block_tables, tokens (B, chunk), positions, valid, table_rows)
        -> PrefillOutput(planes, block_tables, logits (B, V), next_tokens (B,), hidden (B, chunk, d))
    decode(params, planes, block_tables, tokens (B, 1), positions, valid, table_rows)
        -> DecodeOutput(planes, block_tables, logits (B, V), next_tokens (B,), hidden (B, 1, d))
    verify(params, planes, block_tables, tokens (B, K + 1), positions, valid, table_rows)
        -> VerifyOutput(planes, block_tables, logits (B, K + 1, V), target_tokens (B, K + 1),
                        num_accepted (B,), hidden (B, K + 1, d))
    mtp_extend(params, mtp_planes, mtp_block_tables, hidden (B, T, d), next_tokens (B, T),
               positions, valid, table_rows)
        -> MTPExtendOutput(planes, block_tables, logits (B, V), hidden (B, d))
    mtp_draft(params, mtp_planes, mtp_block_tables, hidden (B, T, d), next_tokens (B, T),
              positions, valid, table_rows)
        -> MTPDraftOutput(planes, block_tables, drafts (B, K), draft_logits (B, K, V))
    ragged(params, planes, block_tables, tokens (N,), positions (R,), query_starts (R + 1,),
           table_rows (R,))
        -> RaggedOutput(planes, block_tables, logits (R, V), next_tokens (R,))

``ragged`` is a ragged batch (:func:`~ninfer_kv.models.decoder.model.forward_ragged`): row ``r``
feeds tokens ``[query_starts[r], query_starts[r + 1])`` from position ``positions[r]`` — a decode
of one token beside a prefill chunk of hundreds, each paying for its own tokens only.  ``N`` is a
token bucket (``step_config.token_buckets``; pad with
:func:`~ninfer_kv.models.decoder.padding.pad_ragged`), ``R`` a batch bucket; logits and the next
token are taken at each row's last token and produced at ``positions + length``.

positions, valid, table_rows are int32 ``(B,)``; ``kv_lens = positions + valid`` is formed inside.

Sampling: prefill, decode and verify take an optional last argument ``sampling``, a
:class:`~ninfer_kv.models.decoder.sampling.SamplingRows` of ``(B,)`` rows (temperature, top-k,
top-p, the sequence's key), and then choose ``next_tokens`` / ``target_tokens`` with
:func:`~ninfer_kv.models.decoder.sampling.sample_tokens`, folding each row's key with the sequence
position of the token it produces (``positions + valid`` for prefill and decode,
``positions + i + 1`` for verify).  Without it the choice is greedy.  A call with and one without
``sampling`` are two signatures (each compiles once per bucket).  Verify accepts a draft iff it equals
the token sampling would produce at that position, so speculative rounds produce exactly the tokens of
plain decoding with the same keys.
Padding rows (``tokens 0, positions 0, valid 0``, table row = any scratch row) write nothing and
read nothing; their outputs are finite and must be ignored (:mod:`ninfer_kv.models.decoder.padding`).
``logits``/``next_tokens``/``hidden`` of prefill, decode and MTP extend are taken at each row's last
valid token (index ``max(valid - 1, 0)``).  Verify: row ``b`` feeds ``tokens[b] = (t, d_1 .. d_K)``;
``target_tokens[b, i]`` is the greedy target at position ``positions[b] + i + 1`` and
``num_accepted[b]`` is the length of the longest prefix of drafts with ``d_i == target_tokens[b, i - 1]``
among ``i < valid[b]``; the bonus token is ``target_tokens[b, num_accepted[b]]``.

Compile counter: every step counts (a) *traces* — a Python side effect in the traced function,
recorded per input signature, and (b) *compiles* — XLA compilations of this very function,
observed through ``jax.monitoring``'s compile event filtered by the step's unique function
name.  ``compiles`` is what a recompilation check should assert; ``traces`` cross-checks it (a
trace without a compile or a compile without a trace both indicate a bug).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import weakref
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from ...schema.kinds import PoolKind
from ...device.state import KVDeviceState
from ...device.work import apply_work
from ...ops.ffi.packed_weight import PackedWeight
from ...ops.registry import resolve_impl
from .config import StepConfig
from .layers import Products, packed_products_fastest, products
from .model import forward_ragged, forward_paged, logits_from_hidden
from .mtp import mtp_draft_paged, mtp_forward_paged
from .sampling import SamplingRows, greedy_tokens, sample_tokens
from .weights import pack_params

__all__ = [
    "CompileCounter",
    "CountedStep",
    "ModelSteps",
    "make_steps",
    "shared_steps",
    "PrefillOutput",
    "DecodeOutput",
    "VerifyOutput",
    "MTPExtendOutput",
    "MTPDraftOutput",
    "RaggedOutput",
    "DONATED_ARGNUMS",
    "STATE_DONATED_ARGNUMS",
    "accepted_prefix",
]

DONATED_ARGNUMS = (1, 2)
"""Positional indices of the donated arguments of every step: ``planes`` and ``block_tables``."""

STATE_DONATED_ARGNUMS = (1,)
"""The donated argument of every state step: the :class:`~ninfer_kv.KVDeviceState`."""

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class PrefillOutput(NamedTuple):
    planes: dict
    block_tables: jax.Array
    logits: jax.Array  # float32 (B, V) at the last valid token
    next_tokens: jax.Array  # int32 (B,) greedy, or sampled with a sampling argument
    hidden: jax.Array  # (B, chunk, d) every position, before the final norm (input of mtp_extend)
    rings: dict | None = None  # the window rings' planes (a model with ring layers, state steps)


class DecodeOutput(NamedTuple):
    planes: dict
    block_tables: jax.Array
    logits: jax.Array  # float32 (B, V)
    next_tokens: jax.Array  # int32 (B,)
    hidden: jax.Array  # (B, 1, d)
    rings: dict | None = None  # the window rings' planes (a model with ring layers, state steps)


class VerifyOutput(NamedTuple):
    planes: dict
    block_tables: jax.Array
    logits: jax.Array  # float32 (B, K + 1, V)
    target_tokens: jax.Array  # int32 (B, K + 1)
    num_accepted: jax.Array  # int32 (B,)
    hidden: jax.Array  # (B, K + 1, d)
    rings: dict | None = None  # the window rings' planes (a model with ring layers, state steps)


class RaggedOutput(NamedTuple):
    planes: dict
    block_tables: jax.Array
    logits: jax.Array  # float32 (R, V) at each row's last token
    next_tokens: jax.Array  # int32 (R,)
    rings: dict | None = None  # the window rings' planes (a model with ring layers, state steps)


class MTPExtendOutput(NamedTuple):
    planes: dict
    block_tables: jax.Array
    logits: jax.Array  # float32 (B, V) MTP logits at the last valid pair
    hidden: jax.Array  # (B, d) MTP hidden at the last valid pair


class MTPDraftOutput(NamedTuple):
    planes: dict
    block_tables: jax.Array
    drafts: jax.Array  # int32 (B, K)
    draft_logits: jax.Array  # float32 (B, K, V)


# -- compile counter -------------------------------------------------------------------------------


class CompileCounter:
    """Thread-safe counts of traces and XLA compiles of one jitted function.

    ``traces_by_signature`` / ``compiles_by_signature`` key each count by the abstract signature
    of the trace that preceded it (shapes and dtypes of the array arguments, params excluded).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._traces: collections.Counter = collections.Counter()
        self._compiles: collections.Counter = collections.Counter()
        self._last_signature = None

    def record_trace(self, signature) -> None:
        with self._lock:
            self._traces[signature] += 1
            self._last_signature = signature

    def record_compile(self) -> None:
        with self._lock:
            self._compiles[self._last_signature] += 1

    @property
    def traces(self) -> int:
        with self._lock:
            return sum(self._traces.values())

    @property
    def compiles(self) -> int:
        with self._lock:
            return sum(self._compiles.values())

    def traces_by_signature(self) -> dict:
        with self._lock:
            return dict(self._traces)

    def compiles_by_signature(self) -> dict:
        with self._lock:
            return dict(self._compiles)


class _CompileEvents:
    """One process-wide ``jax.monitoring`` listener routing compile events to counters."""

    _lock = threading.Lock()
    _counters: "weakref.WeakValueDictionary[str, CompileCounter]" = weakref.WeakValueDictionary()
    _registered = False

    @classmethod
    def watch(cls, fun_name: str, counter: CompileCounter) -> None:
        with cls._lock:
            if not cls._registered:
                monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True
            cls._counters[fun_name] = counter

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event != _BACKEND_COMPILE_EVENT:
            return
        name = kwargs.get("fun_name", "")
        # jit reports "jit(<function name>)"; the step names are unique in the process.
        inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
        counter = cls._counters.get(inner)
        if counter is not None:
            counter.record_compile()


def _signature(args) -> tuple:
    """Shapes and dtypes of every array leaf of ``args`` (the graph key jit sees)."""
    leaves = jax.tree_util.tree_leaves(args)
    return tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


_step_ids = itertools.count()


class CountedStep:
    """A jitted step with a :class:`CompileCounter`.

    Args:
      name: the step's name (``prefill``, ``decode``, ...); the jitted function is named
        ``<name>_step<N>`` with a process-unique ``N`` so compile events can be attributed.
      fn: the step body, ``fn(params, planes, block_tables, *int32_and_activation_args)``.
      check: host-side argument check run before every dispatch (raises ``ValueError``).
      donate_argnums: donated positional arguments (default: planes and block tables).
    """

    def __init__(self, name: str, fn: Callable, check: Callable, donate_argnums=DONATED_ARGNUMS):
        self.name = name
        self.counter = CompileCounter()
        self._check = check
        fun_name = f"{name}_step{next(_step_ids)}"

        def traced(params, *args):
            self.counter.record_trace(_signature(args))
            return fn(params, *args)

        traced.__name__ = traced.__qualname__ = fun_name
        self.fun_name = fun_name
        self.donate_argnums = tuple(donate_argnums)
        _CompileEvents.watch(fun_name, self.counter)
        self._jitted = jax.jit(traced, donate_argnums=self.donate_argnums)

    def __call__(self, *args):
        self._check(*args)
        return self._jitted(*args)

    def lower(self, *args):
        """``jax.jit(...).lower`` of the step (e.g. for ``.compile().memory_analysis()``).

        Lowering traces and compiling the lowered step compiles: both are counted like a call.
        """
        self._check(*args)
        return self._jitted.lower(*args)

    @property
    def compiles(self) -> int:
        """XLA compilations of this step so far."""
        return self.counter.compiles

    @property
    def traces(self) -> int:
        """Traces of this step so far (one per new input signature)."""
        return self.counter.traces

    def __repr__(self) -> str:
        return f"CountedStep({self.name!r}, compiles={self.compiles}, traces={self.traces})"


# -- argument checks ---------------------------------------------------------------------------------


def _shape(x) -> tuple:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_int32_vector(name: str, x, b: int) -> None:
    shape = _shape(x)
    if shape != (b,) or np.dtype(x.dtype) != np.int32:
        raise ValueError(f"{name} must be int32 ({b},), got {np.dtype(x.dtype).name} {shape}")


def _check_pool(what: str, planes, block_tables) -> None:
    if not isinstance(planes, dict):
        raise TypeError(f"{what}: planes must be the dict of stacked plane arrays, got {type(planes).__name__}")
    bt = _shape(block_tables)
    if len(bt) != 2 or np.dtype(block_tables.dtype) != np.int32:
        raise ValueError(f"{what}: block_tables must be int32 (C, L), got {np.dtype(block_tables.dtype).name} {bt}")


def _check_bucket(cfg: StepConfig, what: str, b: int, pad_with: str) -> None:
    if b not in cfg.batch_buckets:
        raise ValueError(
            f"{what}: batch size {b} is not a bucket {cfg.batch_buckets}; pad the batch with "
            f"ninfer_kv.models.decoder.padding.{pad_with}"
        )


def _check_common(cfg: StepConfig, what: str, planes, block_tables, lead, positions, valid, table_rows, t_expected):
    """Checks of the per-row arguments; ``lead`` is tokens (B, T) or hidden (B, T, d)."""
    _check_pool(what, planes, block_tables)
    shape = _shape(lead)
    b = shape[0]
    _check_bucket(cfg, what, b, "pad_rows")
    if t_expected is not None and shape[1] != t_expected:
        raise ValueError(f"{what}: expected {t_expected} tokens per row, got shape {shape}")
    for name, x in (("positions", positions), ("valid", valid), ("table_rows", table_rows)):
        _check_int32_vector(f"{what}: {name}", x, b)
    return b, shape[1]


def _check_tokens(name: str, tokens) -> None:
    if np.dtype(tokens.dtype) != np.int32 or len(_shape(tokens)) != 2:
        raise ValueError(f"{name} must be int32 (B, T), got {np.dtype(tokens.dtype).name} {_shape(tokens)}")


def _check_sampling(what: str, sampling, b: int) -> None:
    if sampling is None:
        return
    if not isinstance(sampling, SamplingRows):
        raise TypeError(f"{what}: sampling must be a SamplingRows or None, got {type(sampling).__name__}")
    want = {"temperature": ((b,), np.float32), "top_k": ((b,), np.int32), "top_p": ((b,), np.float32),
            "key": ((b, 2), np.uint32)}
    for name, (shape, dtype) in want.items():
        x = getattr(sampling, name)
        if _shape(x) != shape or np.dtype(x.dtype) != dtype:
            raise ValueError(f"{what}: sampling.{name} must be {np.dtype(dtype).name} {shape}, got "
                             f"{np.dtype(x.dtype).name} {_shape(x)}")


def _token_check(cfg: StepConfig, what: str, t_expected: int):
    def check(params, planes, block_tables, tokens, positions, valid, table_rows, sampling=None):
        _check_tokens(f"{what}: tokens", tokens)
        b, _ = _check_common(cfg, what, planes, block_tables, tokens, positions, valid, table_rows, t_expected)
        _check_sampling(what, sampling, b)

    return check


def _ragged_check(cfg: StepConfig):
    what = "ragged"

    def check(params, planes, block_tables, tokens, positions, query_starts, table_rows, sampling=None):
        shape = _shape(tokens)
        if np.dtype(tokens.dtype) != np.int32 or len(shape) != 1:
            raise ValueError(f"{what}: tokens must be int32 (N,), got {np.dtype(tokens.dtype).name} {shape}")
        if shape[0] not in cfg.token_buckets:
            raise ValueError(f"{what}: {shape[0]} tokens is not a token bucket {cfg.token_buckets}; pad with "
                             f"ninfer_kv.models.decoder.padding.pad_ragged")
        _check_pool(what, planes, block_tables)
        rows = _shape(table_rows)
        if len(rows) != 1:
            raise ValueError(f"{what}: table_rows must be int32 (R,), got shape {rows}")
        r = rows[0]
        _check_bucket(cfg, what, r, "pad_ragged")
        for name, x, n in (("positions", positions, r), ("table_rows", table_rows, r),
                           ("query_starts", query_starts, r + 1)):
            _check_int32_vector(f"{what}: {name}", x, n)
        _check_sampling(what, sampling, r)

    return check


def _mtp_check(cfg: StepConfig, what: str):
    d = cfg.model.d_model

    def check(params, planes, block_tables, hidden, next_tokens, positions, valid, table_rows):
        hs = _shape(hidden)
        if len(hs) != 3 or hs[2] != d:
            raise ValueError(f"{what}: hidden must be (B, T, {d}), got {hs}")
        _check_tokens(f"{what}: next_tokens", next_tokens)
        if _shape(next_tokens) != hs[:2]:
            raise ValueError(f"{what}: next_tokens shape {_shape(next_tokens)} must equal hidden's (B, T) {hs[:2]}")
        _check_common(cfg, what, planes, block_tables, hidden, positions, valid, table_rows, None)

    return check


# -- step bodies -----------------------------------------------------------------------------------


def _at_index(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[b, idx[b]]`` for ``x (B, T, ...)``."""
    return jax.vmap(lambda row, i: row[i])(x, idx)


def _greedy(logits: jax.Array) -> jax.Array:
    return greedy_tokens(logits)


def _choose(logits: jax.Array, sampling: SamplingRows | None, produced: jax.Array) -> jax.Array:
    """Tokens from ``logits (B, V)``: greedy without ``sampling``, else sampled at positions ``produced (B,)``."""
    if sampling is None:
        return _greedy(logits)
    return sample_tokens(logits, sampling, produced)


def _choose_chunk(logits: jax.Array, sampling: SamplingRows | None, positions: jax.Array) -> jax.Array:
    """Tokens from ``logits (B, T, V)``; token ``t`` of row ``b`` is produced at ``positions[b] + t + 1``."""
    if sampling is None:
        return _greedy(logits)
    b, t, v = logits.shape
    rep = jax.tree_util.tree_map(lambda x: jnp.repeat(jnp.asarray(x), t, axis=0), sampling)
    produced = (positions[:, None] + jnp.arange(1, t + 1, dtype=jnp.int32)[None, :]).reshape(b * t)
    return sample_tokens(logits.reshape(b * t, v), rep, produced).reshape(b, t)


def accepted_prefix(tokens: jax.Array, target: jax.Array, valid: jax.Array) -> jax.Array:
    """Accepted drafts per row: longest ``n`` with ``tokens[:, i] == target[:, i - 1]`` for ``1 <= i <= n``, ``i < valid``."""
    k = tokens.shape[1] - 1
    i = jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]
    ok = (tokens[:, 1:] == target[:, :-1]) & (i < valid[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


class ModelSteps:
    """The jitted step functions for one :class:`StepConfig` (see the module docstring).

    Attributes ``prefill``, ``decode``, ``verify`` (Main pool) and, when ``model.mtp``,
    ``mtp_extend`` and ``mtp_draft`` (MTP pool) are :class:`CountedStep` objects.
    """

    def __init__(self, step_config: StepConfig):
        if not isinstance(step_config, StepConfig):
            raise TypeError(f"step_config must be a StepConfig, got {type(step_config).__name__}")
        self.config = step_config
        cfg = step_config
        model = cfg.model
        main_layout = cfg.main_layout
        impl = cfg.impl
        in_products = _in_products(cfg)

        def run_main(params, planes, block_tables, tokens, positions, valid, table_rows, rings):
            return forward_paged(
                params, model, main_layout, planes, block_tables, tokens, positions, valid, table_rows, impl=impl,
                rings=rings,
            )

        @in_products
        def prefill(params, planes, block_tables, tokens, positions, valid, table_rows, sampling=None, *, rings=None):
            hidden, planes, rings = run_main(params, planes, block_tables, tokens, positions, valid, table_rows, rings)
            last = _at_index(hidden, jnp.maximum(valid - 1, 0))
            logits = logits_from_hidden(params, model, last)
            chosen = _choose(logits, sampling, jnp.asarray(positions, jnp.int32) + jnp.asarray(valid, jnp.int32))
            return PrefillOutput(planes, block_tables, logits, chosen, hidden, rings)

        @in_products
        def decode(params, planes, block_tables, tokens, positions, valid, table_rows, sampling=None, *, rings=None):
            hidden, planes, rings = run_main(params, planes, block_tables, tokens, positions, valid, table_rows, rings)
            logits = logits_from_hidden(params, model, hidden[:, 0])
            chosen = _choose(logits, sampling, jnp.asarray(positions, jnp.int32) + jnp.asarray(valid, jnp.int32))
            return DecodeOutput(planes, block_tables, logits, chosen, hidden, rings)

        @in_products
        def verify(params, planes, block_tables, tokens, positions, valid, table_rows, sampling=None, *, rings=None):
            hidden, planes, rings = run_main(params, planes, block_tables, tokens, positions, valid, table_rows, rings)
            logits = logits_from_hidden(params, model, hidden)
            target = _choose_chunk(logits, sampling, jnp.asarray(positions, jnp.int32))
            accepted = accepted_prefix(tokens, target, valid)
            return VerifyOutput(planes, block_tables, logits, target, accepted, hidden, rings)

        @in_products
        def ragged(params, planes, block_tables, tokens, positions, query_starts, table_rows, sampling=None, *,
                   rings=None):
            hidden, e, planes, rings = forward_ragged(params, model, main_layout, planes, block_tables, tokens,
                                                      positions, query_starts, table_rows, impl=impl, rings=rings)
            logits = logits_from_hidden(params, model, hidden[jnp.maximum(e[1:] - 1, 0)])  # each row's last token
            lengths = e[1:] - e[:-1]
            chosen = _choose(logits, sampling, jnp.asarray(positions, jnp.int32) + lengths)
            return RaggedOutput(planes, block_tables, logits, chosen, rings)

        self.prefill = CountedStep("prefill", prefill, _token_check(cfg, "prefill", cfg.prefill_chunk))
        self.decode = CountedStep("decode", decode, _token_check(cfg, "decode", 1))
        self.verify = CountedStep("verify", verify, _token_check(cfg, "verify", cfg.draft_window + 1))
        self.ragged = CountedStep("ragged", ragged, _ragged_check(cfg))
        self._steps = {"prefill": self.prefill, "decode": self.decode, "verify": self.verify, "ragged": self.ragged}
        self._state_steps = {
            name: _state_step(name, PoolKind.MAIN, fn, self._steps[name]._check, cfg.ring_spec)
            for name, fn in (("prefill", prefill), ("decode", decode), ("verify", verify), ("ragged", ragged))
        }

        if model.mtp:
            mtp_layout = cfg.mtp_layout

            @in_products
            def mtp_extend(params, planes, block_tables, hidden, next_tokens, positions, valid, table_rows):
                g, logits, planes = mtp_forward_paged(
                    params, model, mtp_layout, planes, block_tables, hidden, next_tokens, positions, valid,
                    table_rows, impl=impl,
                )
                idx = jnp.maximum(valid - 1, 0)
                return MTPExtendOutput(planes, block_tables, _at_index(logits, idx), _at_index(g, idx))

            @in_products
            def mtp_draft(params, planes, block_tables, hidden, next_tokens, positions, valid, table_rows):
                drafts, draft_logits, planes = mtp_draft_paged(
                    params, model, mtp_layout, planes, block_tables, hidden, next_tokens, positions, valid,
                    table_rows, num_drafts=cfg.draft_window, impl=impl,
                )
                return MTPDraftOutput(planes, block_tables, drafts, draft_logits)

            self.mtp_extend = CountedStep("mtp_extend", mtp_extend, _mtp_check(cfg, "mtp_extend"))
            self.mtp_draft = CountedStep("mtp_draft", mtp_draft, _mtp_check(cfg, "mtp_draft"))
            self._steps.update(mtp_extend=self.mtp_extend, mtp_draft=self.mtp_draft)
            for name, fn in (("mtp_extend", mtp_extend), ("mtp_draft", mtp_draft)):
                self._state_steps[name] = _state_step(name, PoolKind.MTP, fn, self._steps[name]._check)
        self._steps.update({f"{name}_state": step for name, step in self._state_steps.items()})

    @property
    def steps(self) -> dict[str, CountedStep]:
        """The step functions by name (``<name>`` over planes and tables, ``<name>_state`` over a
        :class:`~ninfer_kv.KVDeviceState`)."""
        return dict(self._steps)

    def on_state(self, name: str) -> CountedStep:
        """The state step of ``name``: ``(params, state, work, *args) -> (state, output)``.

        It applies the round ``work`` to the donated ``state`` (:func:`~ninfer_kv.apply_work`),
        then runs step ``name`` on the pool's planes and block tables, all in one dispatch.  The
        output's ``planes`` and ``block_tables`` are ``None``: they live in the returned state.
        """
        try:
            return self._state_steps[name]
        except KeyError:
            raise ValueError(f"unknown step {name!r}; steps: {sorted(self._state_steps)}") from None

    def prepare_params(self, params: dict) -> dict:
        """``params`` as these steps run them fastest: with the bfloat16 projections and the LM head
        packed once (:func:`~ninfer_kv.models.decoder.weights.pack_params`) when the ops resolve to
        the FFI and the products are ``"batch_invariant"``, or ``"auto"`` on a CPU where the packed
        products are the fastest (:func:`~ninfer_kv.models.decoder.layers.packed_products_fastest`),
        else ``params`` itself.  Call it once, after loading, and pass the result to every step; the
        steps also take plain params."""
        if self.config.products == Products.XLA.value or resolve_impl(self.config.impl).name != "ffi":
            return params
        if self.config.products == Products.AUTO.value and not packed_products_fastest():
            return params
        return pack_params(params, self.config.model)

    def compiles(self) -> dict[str, int]:
        """Backend compilations per step function."""
        return {name: s.compiles for name, s in self._steps.items()}

    def traces(self) -> dict[str, int]:
        """Traces per step function."""
        return {name: s.traces for name, s in self._steps.items()}


def _state_step(name: str, pool: PoolKind, fn: Callable, check: Callable, ring_spec=None) -> CountedStep:
    """``fn(params, planes, tables, *args)`` as a step over a state and a round work; with
    ``ring_spec`` (the model's :class:`~ninfer_kv.planning.rings.WindowRings`), ``fn`` also takes and
    returns the state's window rings (``rings=``)."""

    def body(params, state, work, *args):
        state = apply_work(state, work)
        if ring_spec is None:
            out = fn(params, state.planes[pool], state.tables[pool], *args)
            state = state.replace(planes={**state.planes, pool: out.planes})
        else:
            out = fn(params, state.planes[pool], state.tables[pool], *args, rings=state.rings)
            state = state.replace(planes={**state.planes, pool: out.planes}, rings=out.rings)
            out = out._replace(rings=None)
        return state, out._replace(planes=None, block_tables=None)

    def check_arguments(params, state, work, *args):
        if not isinstance(state, KVDeviceState):
            raise TypeError(f"{name}: state must be a KVDeviceState, got {type(state).__name__}")
        have = None if state.ring is None else dataclasses.replace(state.ring.spec, snapshots=0)
        if have != ring_spec:
            raise ValueError(f"{name}: the state's window rings ({have}) are not the model's ({ring_spec}); allocate "
                             f"the state from a plan of the model's kv_config")
        shaped = state.replace(work_pending=False)  # shapes and dtypes: the same before and after the work
        check(params, shaped.pool_planes(pool), shaped.table(pool), *args)

    return CountedStep(f"{name}_state", body, check_arguments, donate_argnums=STATE_DONATED_ARGNUMS)


def _in_products(cfg: StepConfig) -> Callable[[Callable], Callable]:
    """A decorator running a step body under the weight-product mode of ``cfg`` (read when traced).

    ``cfg.products`` applies when the ops resolve to the FFI implementation (a CPU with the
    library); every other implementation traces XLA's dots.  ``"auto"`` over packed weights
    (:meth:`ModelSteps.prepare_params`) is batch invariant: the packed products are by
    construction, so the norms and the attention follow (:attr:`Products.BATCH_INVARIANT`, which
    costs nothing more there).
    """

    def mode(params) -> Products:
        if cfg.products == Products.XLA.value or resolve_impl(cfg.impl).name != "ffi":
            return Products.XLA
        if cfg.products == Products.AUTO.value and _has_packed_weights(params):
            return Products.BATCH_INVARIANT
        return Products(cfg.products)

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def body(params, *args, **kwargs):
            with products(mode(params)):
                return fn(params, *args, **kwargs)
        return body

    return wrap


def _has_packed_weights(params) -> bool:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, PackedWeight))
    return any(isinstance(x, PackedWeight) for x in leaves)


def make_steps(step_config: StepConfig) -> ModelSteps:
    """Build the jitted step functions for ``step_config``."""
    return ModelSteps(step_config)


@functools.lru_cache(maxsize=8)
def shared_steps(step_config: StepConfig) -> ModelSteps:
    """The step functions of ``step_config``, shared by every user of an equal config (the params are
    arguments, not constants of the programs), so a second generator or engine of the same model and
    buckets reuses the compiled programs instead of tracing and compiling them again."""
    return make_steps(step_config)
