"""The ``ninfer-kv generate`` subcommand: continue a prompt with a Hugging Face checkpoint, streaming.

::

    ninfer-kv generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-p P]
        [--top-k K] [--seed S] [--kv-cache-dtype bf16|int8|fp8|nvfp4|k8v4] [--dtype bfloat16|float32]
        [--max-context S] [--impl auto|ffi|pallas|reference] [--json]

With a ``tokenizer.json`` in DIR the prompt is text and the output streams as text; without one the
prompt is token ids (``"1 2 3"`` or ``"1,2,3"``) and the output streams token ids.  Generation stops
at an EOS id (``generation_config.json``, else ``config.json``) or after ``--max-new-tokens``.  A
summary line (tokens, speed, finish reason) goes to stderr; ``--json`` prints one JSON object instead
of the stream.  This module only declares arguments; the model code is imported when it runs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from .registry import CommandOutput, register_subcommand
from .types import POSITIVE_INT, PROFILE, PROFILE_HELP, arg_type, bounded_int

__all__ = ["configure", "run", "parse_token_ids"]

DEFAULT_MAX_NEW_TOKENS = 64
_DTYPES = ("bfloat16", "float32")
_IMPLS = ("auto", "pallas", "ffi", "reference")


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
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}; EOS stops earlier)")
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
    p.add_argument("--max-context", type=POSITIVE_INT, default=None, metavar="S",
                   help="tokens per sequence (default: prompt + --max-new-tokens, at most the model's context)")
    p.add_argument("--impl", type=_choice("impl", _IMPLS), default="auto",
                   help="op implementation: auto (FFI on CPU, Pallas on GPU; default), ffi, pallas, reference")


def run(args: argparse.Namespace) -> CommandOutput | None:
    """Load the checkpoint, generate, stream the output (or return it for ``--json``)."""
    from ..models.decoder.sampling import SamplingConfig
    from ..models.generate import PagedGenerator
    from ..models.hf import eos_token_ids, load_checkpoint, load_tokenizer, model_config_from_hf, read_config

    directory = args.model
    tokenizer = load_tokenizer(directory) if _is_dir(directory) else None
    prompt = tokenizer.encode(args.prompt) if tokenizer is not None else parse_token_ids(args.prompt)
    if not prompt:
        raise ValueError("--prompt encodes to no tokens")
    _, info = model_config_from_hf(read_config(directory), dtype=args.dtype)  # refusals before any weight
    context = args.max_context
    if context is None:
        context = min(len(prompt) + args.max_new_tokens, max(info.max_position_embeddings, len(prompt) + 1))
    if len(prompt) >= context:
        raise ValueError(f"--max-context {context} leaves no room after the prompt's {len(prompt)} tokens "
                         f"(allowed: >= {len(prompt) + 1})")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model = load_checkpoint(directory, dtype=args.dtype, max_context=context)
    stops = eos_token_ids(directory, model.info.eos_token_ids)
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


def _is_dir(path: str) -> bool:
    import os

    return os.path.isdir(path)


register_subcommand(
    "generate",
    help="continue a prompt with a Hugging Face checkpoint (Qwen3, Qwen2, Llama, Mistral), streaming the output",
    configure=configure,
    run=run,
)
