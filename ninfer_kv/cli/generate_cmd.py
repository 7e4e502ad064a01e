"""The ``ninfer-kv generate`` subcommand: continue a prompt with a Hugging Face checkpoint, streaming.

::

    ninfer-kv generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-p P]
        [--top-k K] [--seed S] [--kv-cache-dtype bf16|int8|fp8|nvfp4|k8v4] [--dtype bfloat16|float32]
        [--max-context S] [--impl auto|ffi|pallas|pallas_tpu|reference] [--json]

With a ``tokenizer.json`` in DIR the prompt is text and the output streams as text; without one the
prompt is token ids (``"1 2 3"`` or ``"1,2,3"``) and the output streams token ids.  Generation stops
at an EOS id (``generation_config.json``, else ``config.json``) or after ``--max-new-tokens``.  A
summary line (tokens, speed, finish reason) goes to stderr; ``--json`` prints one JSON object instead
of the stream.  This module only declares arguments; the model code is imported when it runs.

Every number is bounded before anything is allocated (one line naming the flag, the value and the
limit, exit status 2): ``--max-new-tokens`` and ``--max-context`` by the int32 position ceiling, then
``--max-context`` by the model's ``max_position_embeddings`` (read from ``config.json`` before the
weights), the context (``--max-context``, else prompt + ``--max-new-tokens`` clipped to the model's)
by the memory its KV cache would need.  A ``--model`` that is not a directory is named as such
before the prompt is read.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from ..planning.bounds import MAX_CONTEXT
from ..schema.sizes import format_bytes
from .registry import CommandOutput, register_subcommand
from .types import IMPL, IMPL_HELP, PROFILE, PROFILE_HELP, arg_type, bounded_int

__all__ = ["configure", "run", "parse_token_ids"]

DEFAULT_MAX_NEW_TOKENS = 64
_DTYPES = ("bfloat16", "float32")


def _float_in(name: str, low: float, high: float, *, low_open: bool = False):
    allowed = f"a number in {'(' if low_open else '['}{low}, {high}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number; it must be {allowed}") from None
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise ValueError(f"{value} is out of range; it must be {allowed}")
        return value

    return arg_type(name, parse)


def _choice(name: str, allowed: tuple[str, ...]):
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in allowed:
            raise ValueError(f"{name} {text!r} is not supported; allowed: {', '.join(allowed)}")
        return value

    return arg_type(name, parse)


def parse_token_ids(text: str) -> list[int]:
    """Token ids written as ``"1 2 3"`` or ``"1,2,3"`` (``ValueError`` naming the bad item)."""
    items = text.replace(",", " ").split()
    if not items:
        raise ValueError("--prompt is empty; without a tokenizer.json it must be token ids such as '1 2 3'")
    out = []
    for item in items:
        try:
            value = int(item, 10)
        except ValueError:
            raise ValueError(
                f"--prompt item {item!r} is not a token id; the checkpoint has no tokenizer.json, so the prompt "
                f"must be integer token ids such as '1 2 3'"
            ) from None
        if value < 0:
            raise ValueError(f"--prompt token id {value} is negative; token ids are integers >= 0")
        out.append(value)
    return out


def configure(p: argparse.ArgumentParser) -> None:
    """Declare the command's arguments."""
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face checkpoint directory (config.json, "
                   "model.safetensors or model.safetensors.index.json, optional tokenizer.json)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt (token ids when DIR has no tokenizer.json)")
    p.add_argument("--max-new-tokens", type=bounded_int(1, MAX_CONTEXT), default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}; EOS stops earlier; the "
                        f"context clips it)")
    p.add_argument("--temperature", type=_float_in("temperature", 0.0, 100.0), default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=_float_in("top-p", 0.0, 1.0, low_open=True), default=1.0, metavar="P",
                   help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=bounded_int(0, 2**31 - 1), default=0, metavar="K", help="top-k sampling (default 0: off)")
    p.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, metavar="S",
                   help="the sequence's sampling seed (default 0); the same seed gives the same tokens")
    p.add_argument("--profile", "--kv-cache-dtype", dest="profile", type=PROFILE, default="bf16",
                   help=f"{PROFILE_HELP} (default bf16)")
    p.add_argument("--dtype", type=_choice("dtype", _DTYPES), default="bfloat16",
                   help="weights and activations: bfloat16 (default) or float32")
    p.add_argument("--max-context", type=bounded_int(1, MAX_CONTEXT), default=None, metavar="S",
                   help="tokens per sequence, at most the model's max_position_embeddings (default: prompt + "
                        "--max-new-tokens, at most the model's context)")
    p.add_argument("--impl", type=IMPL, default="auto", help=IMPL_HELP)


def run(args: argparse.Namespace) -> CommandOutput | None:
    """Load the checkpoint, generate, stream the output (or return it for ``--json``).

    Everything the command line names is checked before any allocation: the directory, then
    ``config.json`` (the model's context bounds ``--max-context``), the prompt against the vocabulary,
    and the KV cache the context needs against the memory of the device."""
    from ..models.decoder.sampling import SamplingConfig
    from ..models.generate import PagedGenerator, generator_plan
    from ..models.hf import eos_token_ids, load_checkpoint, load_tokenizer, model_config_from_hf, read_config

    directory = _checkpoint_directory(args.model)
    config, info = model_config_from_hf(read_config(directory), dtype=args.dtype)  # refusals before any weight
    model_context = min(info.max_position_embeddings, MAX_CONTEXT)
    if args.max_context is not None and args.max_context > model_context:
        raise ValueError(f"--max-context {args.max_context} exceeds the model's context: max_position_embeddings="
                         f"{info.max_position_embeddings} in {directory}/config.json (allowed: at most {model_context})")
    tokenizer = load_tokenizer(directory)
    prompt = tokenizer.encode(args.prompt) if tokenizer is not None else parse_token_ids(args.prompt)
    if not prompt:
        raise ValueError("--prompt encodes to no tokens")
    _check_vocabulary(prompt, config.vocab_size)
    eos_token_ids(directory, info.eos_token_ids, vocab_size=config.vocab_size)  # a bad EOS: refused before the weights
    context = args.max_context
    if context is None:
        if len(prompt) >= model_context:
            raise ValueError(f"--prompt has {len(prompt)} tokens; the model's context (max_position_embeddings="
                             f"{info.max_position_embeddings}) leaves no room to generate (allowed: at most "
                             f"{model_context - 1} tokens)")
        context = min(len(prompt) + args.max_new_tokens, model_context)
    if len(prompt) >= context:
        raise ValueError(f"--max-context {context} leaves no room after the prompt's {len(prompt)} tokens "
                         f"(allowed: >= {len(prompt) + 1})")
    plan = generator_plan(config, profile=args.profile, max_context=context, max_batch=1)
    _check_memory(plan.device_bytes, context, args)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model = load_checkpoint(directory, dtype=args.dtype, max_context=context)
    stops = model.eos_token_ids  # generation_config.json's, else config.json's (checked above)
    gen = PagedGenerator(model.params, model.config, profile=args.profile, max_context=context, max_batch=1,
                         impl=args.impl)
    stream = not args.json
    decoder = None
    if tokenizer is not None:
        from ..models.hf import StreamDecoder

        decoder = StreamDecoder(tokenizer)
    pieces: list[str] = []

    def on_token(seq, token):
        if seq.finish_reason == "stop":
            return  # the EOS token itself is not shown
        piece = decoder.push(token) if decoder is not None else f"{token} "
        pieces.append(piece)
        if stream and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    start = time.perf_counter()
    seq = gen.add(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop_tokens=stops)
    gen.run(on_token)
    seconds = time.perf_counter() - start
    if decoder is not None:
        tail = decoder.flush()
        pieces.append(tail)
        if stream and tail:
            sys.stdout.write(tail)
    generated = list(seq.generated)
    text = "".join(pieces).rstrip(" ") if decoder is None else "".join(pieces)
    summary = (f"[{len(generated)} tokens in {seconds:.2f} s ({len(generated) / max(seconds, 1e-9):.1f} tokens/s, "
               f"compiles included), finish: {seq.finish_reason}; prompt {len(prompt)} tokens; load {model.load_seconds:.2f} s]")
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(summary, file=sys.stderr)
        return None
    data = {
        "prompt_tokens": prompt,
        "tokens": generated,
        "text": text if decoder is not None else None,
        "finish_reason": seq.finish_reason,
        "eos_token_ids": list(stops),
        "seconds": seconds,
        "load_seconds": model.load_seconds,
        "profile": gen.steps.config.profile.value,
        "dtype": args.dtype,
        "max_context": context,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    return CommandOutput(data=data, text=text)


def _checkpoint_directory(path: str) -> str:
    """``path`` when it is a directory; a ``ValueError`` naming ``--model`` otherwise."""
    if os.path.isdir(path):
        return path
    if not os.path.exists(path):
        raise ValueError(f"--model {path}: no such directory")
    kind = "a file" if os.path.isfile(path) else "not a regular file"
    raise ValueError(f"--model {path}: is {kind}, not a directory (a Hugging Face checkpoint directory with "
                     f"config.json and the weights)")


def _check_vocabulary(prompt: list[int], vocab: int) -> None:
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab:
            raise ValueError(f"--prompt token {i}: {token} is outside the vocabulary [0, {vocab}) of the model")


def _memory_bytes() -> tuple[int, str] | None:
    """``(bytes, what)``: the first device's memory limit, or the host's physical memory on a device
    that reports none (a CPU); ``None`` when neither is known."""
    import jax

    from ..device.memory import device_memory_limit, host_memory_bytes

    device = jax.devices()[0]
    limit = device_memory_limit(device)
    if limit is not None:
        return limit, f"the {device.platform} device holds"
    host = host_memory_bytes()
    return None if host is None else (host, "the host holds")


def _check_memory(kv_bytes: int, context: int, args: argparse.Namespace) -> None:
    """Refuse a context whose KV cache alone exceeds the memory it would be allocated in."""
    known = _memory_bytes()
    if known is None or kv_bytes <= known[0]:
        return
    limit, where = known
    flag = (f"--max-context {args.max_context}" if args.max_context is not None
            else f"--max-new-tokens {args.max_new_tokens} (a context of {context} tokens)")
    raise ValueError(f"{flag}: the KV cache needs {format_bytes(kv_bytes)} ({args.profile.value}) but "
                     f"{where} {format_bytes(limit)} in all; lower it")


register_subcommand(
    "generate",
    help="continue a prompt with a Hugging Face checkpoint (Qwen3, Qwen2, Llama, Mistral), streaming the output",
    configure=configure,
    run=run,
)
