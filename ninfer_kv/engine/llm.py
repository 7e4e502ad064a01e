"""``LLM``: offline generation over the engine, with vLLM's names.

::

    from ninfer_kv.engine import LLM, SamplingParams

    llm = LLM(model="path/to/checkpoint", max_model_len=4096, max_num_seqs=16)
    outputs = llm.generate(["The paged KV cache", "Tell me"], SamplingParams(max_tokens=64, temperature=0.7))
    for out in outputs:
        print(out.outputs[0].text, out.num_cached_tokens)

``model`` is a Hugging Face checkpoint directory (Qwen3, Qwen2/2.5, Llama 2/3/3.1, Mistral; see
docs/MODELS.md) or any :class:`~ninfer_kv.engine.model.EngineModel` (then prompts are token ids,
unless a ``tokenizer`` is given).  The KV cache is planned after the weights are loaded
(:func:`~ninfer_kv.engine.capacity.engine_plan`); docs/ENGINE.md describes the policies.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..schema.integers import check_int, int_range, is_int
from ..schema.profiles import KVProfile
from ..store import EntitlementPolicy, KVStore
from .capacity import engine_plan
from .core import EngineCore
from .model import DecoderModel, EngineModel
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "RequestFailedError", "DEFAULT_MAX_NUM_SEQS"]

DEFAULT_MAX_NUM_SEQS = 64
"""Requests served at once unless ``max_num_seqs`` says otherwise (each takes one execution row)."""


class RequestFailedError(RuntimeError):
    """A model step raised while serving these requests (the others completed).

    Attributes:
      request_ids: the failed requests; outputs: every request's output, in submission order.
    """

    def __init__(self, request_ids: list[str], error: str, outputs: list[RequestOutput]):
        super().__init__(f"requests {request_ids} failed: {error}")
        self.request_ids = request_ids
        self.outputs = outputs


class LLM:
    """An engine serving a checkpoint (module docstring).

    Args:
      model: a checkpoint directory, or an :class:`EngineModel`.
      dtype: ``"auto"`` (the checkpoint's: float32 stays float32, anything else is served in
        bfloat16), ``"bfloat16"`` or ``"float32"``.
      kv_cache_dtype: the KV profile (``bf16``, ``fp8``, ``int8``, ``nvfp4``, ``k8v4`` or a profile name).
      max_model_len: tokens per sequence, prompt and output (default: the model's context).
      max_num_seqs: sequences served at once (execution rows).
      kv_capacity: Main pool tokens, or ``"auto"``: from the memory left after the weights.
      host_memory: bytes of the Host tier (0: none) that evicted prefixes are offloaded to.
      enable_prefix_caching: reuse the longest cached prefix of every prompt.
      lease_growth: reserve the prompt and a window (4096 tokens) instead of the whole budget, so more
        requests run at once; one the pool cannot extend ends with finish reason ``"length"``.
      impl: op implementation, one of :func:`ninfer_kv.ops.registry.impl_choices` (``"auto"``: FFI on CPU,
        Pallas on GPU, Mosaic on TPU).
      seed: the seed of requests that give none.
      max_num_batched_tokens: tokens one round feeds at most: every decode's token, then prompt
        tokens in arrival order, in one ragged batch (``None``:
        :data:`~ninfer_kv.schema.buckets.DEFAULT_MAX_NUM_BATCHED_TOKENS`, or ``max_num_seqs`` when
        more).
      tokenizer: with an :class:`EngineModel`, an optional
        :class:`~ninfer_kv.models.hf.tokenizer.TextTokenizer` for text prompts.
      eos_token_ids: with an :class:`EngineModel`, the ids that end a completion.
    """

    def __init__(
        self,
        model: str | os.PathLike | EngineModel,
        *,
        dtype: str = "auto",
        kv_cache_dtype: str = "bf16",
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_capacity: int | str = "auto",
        host_memory: int | str = 0,
        enable_prefix_caching: bool = True,
        lease_growth: bool = False,
        impl: str = "auto",
        seed: int = 0,
        max_num_batched_tokens: int | None = None,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
    ):
        _check_int("max_num_seqs", max_num_seqs, 1, 4096)
        _check_int("seed", seed, 0, 2**32 - 1)
        if max_model_len is not None:
            _check_int("max_model_len", max_model_len, 2, 2**31 - 64)
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("lease_growth", lease_growth)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r} must be True or False")
        profile = KVProfile.parse(kv_cache_dtype)
        self.chat_template = None
        if isinstance(model, EngineModel):
            if max_model_len is None:
                raise ValueError("max_model_len is required with an EngineModel (the model states no context)")
            engine_model, self.tokenizer, eos = model, tokenizer, tuple(int(t) for t in eos_token_ids)
            self.model_config = None
        else:
            engine_model, eos, max_model_len = self._load(str(model), dtype, max_model_len, impl)
        plan = engine_plan(engine_model.kv_config(profile), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           kv_capacity=kv_capacity, ring_snapshots=enable_prefix_caching)
        store = KVStore(plan, host_bytes=host_memory or None, entitlement=EntitlementPolicy(kv_lease_growth=lease_growth))
        self.plan = plan
        self.engine = EngineCore(
            engine_model, store, eos_token_ids=eos, text_state=self._text_state_factory(),
            decode_token=self._decode_token if self.tokenizer is not None else None,
            enable_prefix_caching=enable_prefix_caching, seed=seed, max_num_batched_tokens=max_num_batched_tokens,
        )
        self._ids = 0

    def _load(self, directory: str, dtype: str, max_model_len: int | None, impl: str):
        from ..models.hf import load_checkpoint, load_tokenizer, model_config_from_hf, read_config

        if dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype={dtype!r} is not supported; allowed: auto, bfloat16, float32")
        if not os.path.isdir(directory):
            raise ValueError(f"model={directory!r}: no such directory (a Hugging Face checkpoint directory)")
        _, info = model_config_from_hf(read_config(directory))
        if dtype == "auto":
            dtype = "float32" if info.checkpoint_dtype in ("float32", "torch.float32") else "bfloat16"
        context = max_model_len if max_model_len is not None else info.max_position_embeddings
        if context > info.max_position_embeddings:
            raise ValueError(f"max_model_len={context} exceeds the model's max_position_embeddings="
                             f"{info.max_position_embeddings}")
        loaded = load_checkpoint(directory, dtype=dtype, max_context=context)
        self.tokenizer = load_tokenizer(directory)
        self.model_config = loaded.config
        self.chat_template = _chat_template(directory)
        return DecoderModel(loaded.params, loaded.config, impl=impl), loaded.eos_token_ids, context

    # -- text ---------------------------------------------------------------------------------------------
    def _text_state_factory(self):
        if self.tokenizer is None:
            return None
        from .detokenize import CompletionText

        tokenizer = self.tokenizer
        return lambda prompt_ids, params: CompletionText(tokenizer, prompt_ids, params.stop or ())

    def _decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _encode(self, prompt, where: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where} is text but the model has no tokenizer.json; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"], where)
            raise ValueError(f"{where} must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, list(prompt)
        raise TypeError(f"{where} must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt; returns one :class:`RequestOutput` per prompt, in order.

        ``prompts``: a string, a list of token ids, or a list of strings / token-id lists / dicts
        (``{"prompt_token_ids": [...]}``, ``{"prompt": "..."}``); ``sampling_params``: one for all,
        or one per prompt (default ``SamplingParams()``).  Every prompt is checked before any is
        queued (all or nothing)."""
        items = _as_prompt_list(prompts)
        params = _params_list(sampling_params, len(items))
        encoded = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(items)]
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or several (a list
        of them), rendered with the checkpoint's chat template as transformers renders it."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        params = _params_list(sampling_params, len(conversations))
        encoded = [self.render_chat(conv, add_generation_prompt=add_generation_prompt,
                                    chat_template_kwargs=chat_template_kwargs) for conv in conversations]
        return self._run(encoded, params, use_tqdm)

    def render_chat(self, messages, *, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[int]]:
        """The prompt text of one conversation (the checkpoint's chat template) and its token ids."""
        if self.chat_template is None:
            raise ValueError("the model has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja); use generate()")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **dict(chat_template_kwargs or {}))
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, prompt, where: str = "prompt") -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt as :meth:`generate` takes it (text, token ids or
        a prompt dict); ``ValueError`` / ``TypeError`` naming ``where`` when it is not one."""
        return self._encode(prompt, where)

    def _run(self, encoded, params, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for (text, tokens), p in zip(encoded, params):
                rid = f"{self._ids}"
                engine.add_request(rid, tokens, p, prompt=text)
                self._ids += 1
                ids.append(rid)
        except BaseException:
            for rid in ids:  # all or nothing: nothing queued by this call stays
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while len(results) < len(ids):
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        failed = [rid for rid in ids if results[rid].error is not None]
        ordered = [results[rid] for rid in ids]
        if failed:
            raise RequestFailedError(failed, results[failed[0]].error, ordered)
        return ordered

    def clear_cache(self) -> int:
        """Release every cached prefix (none is in use between calls); returns how many."""
        return self.engine.clear_cache()


def _chat_template(directory: str):
    try:
        from .chat_template import ChatTemplate
    except ImportError:  # jinja2 missing: chat() says so
        return None
    return ChatTemplate.from_directory(directory)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of token ids or a list of prompts, got {type(prompts).__name__}")
    if prompts and all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    return list(prompts)


def _params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts (one for all, or one per prompt)")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def _check_int(name: str, value, low: int, high: int) -> None:
    """:func:`~ninfer_kv.schema.integers.check_int`, with a ``TypeError`` for a value that is no integer."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be {int_range(low, high)}")
    check_int(name, value, low, high)
