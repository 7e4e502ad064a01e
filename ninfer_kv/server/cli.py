"""The ``ninfer-kv serve`` subcommand: an OpenAI-compatible HTTP server on the engine.

Examples::

    ninfer-kv serve --model DIR                              # http://127.0.0.1:8000/v1
    ninfer-kv serve --model DIR --port 9000 --max-model-len 4096 --max-num-seqs 32 --api-key KEY
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "DIR", "prompt": "The paged KV cache", "max_tokens": 32}'

The flags are the engine's, with vLLM's names.  This module only declares arguments; FastAPI,
uvicorn and the engine are imported when the command runs (``pip install "ninfer_kv[serve]"``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..cli import BYTES, POSITIVE_INT, PROFILE, bounded_int, register_subcommand

__all__ = ["configure", "run", "API_KEY_ENV"]

API_KEY_ENV = "NINFER_KV_API_KEY"
"""The environment variable read for the API key when ``--api-key`` is not given."""

_DTYPES = ("auto", "bfloat16", "float32")


def _dtype(text: str) -> str:
    value = str(text).strip().lower()
    if value not in _DTYPES:
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported; allowed: {', '.join(_DTYPES)}")
    return value


def _capacity(text: str):
    value = str(text).strip().lower()
    if value == "auto":
        return value
    return bounded_int(1, 2**40)(text)


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shutdown grace {text!r} is not a number of seconds") from None
    if not 0.0 <= value <= 3600.0:
        raise argparse.ArgumentTypeError(f"shutdown grace {text!r} is out of range; allowed: [0, 3600] seconds")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    """Declare the server's arguments."""
    from ..schema.buckets import DEFAULT_MAX_NUM_BATCHED_TOKENS, MAX_NUM_BATCHED_TOKENS_LIMIT
    from .limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_GRACE

    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face checkpoint directory (Qwen3, Qwen2, "
                   "Llama, Mistral; tokenizer.json for text, the chat template for chat completions)")
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model name clients send (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        f"{API_KEY_ENV} environment variable, else none)")
    p.add_argument("--max-model-len", type=bounded_int(2, 2**31 - 64), default=None, metavar="N",
                   help="tokens per sequence, prompt and output (default: the model's context)")
    p.add_argument("--max-num-seqs", type=bounded_int(1, 4096), default=64, metavar="N",
                   help="sequences served at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1, MAX_NUM_BATCHED_TOKENS_LIMIT), default=None,
                   metavar="N", help="tokens one round feeds at most: the decodes' tokens, then prompt tokens in "
                                     f"arrival order (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, or --max-num-seqs "
                                     "when more)")
    p.add_argument("--kv-cache-dtype", dest="profile", type=PROFILE, default="bf16", help="KV profile (default bf16)")
    p.add_argument("--kv-capacity", type=_capacity, default="auto", metavar="TOKENS|auto",
                   help="Main pool tokens (default auto: from the memory left after the weights)")
    p.add_argument("--host-memory", type=BYTES, default=0, metavar="BYTES",
                   help="Host tier for evicted prefixes (default 0: none)")
    p.add_argument("--dtype", type=_dtype, default="auto", help="weights: auto (default), bfloat16, float32")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the longest cached prefix of every prompt (default on)")
    p.add_argument("--lease-growth", action="store_true",
                   help="lease a window per request instead of its whole budget (more requests at once)")
    p.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="seed of requests that give none")
    p.add_argument("--max-request-bytes", type=BYTES, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help=f"largest request body (default {DEFAULT_MAX_REQUEST_BYTES}); larger ones get 413")
    p.add_argument("--shutdown-grace", type=_grace, default=DEFAULT_SHUTDOWN_GRACE, metavar="SECONDS",
                   help=f"after SIGTERM, seconds running requests get to finish before they are aborted "
                        f"(default {DEFAULT_SHUTDOWN_GRACE:g})")


def run(args: argparse.Namespace) -> None:
    """Load the checkpoint, build the engine and serve until SIGTERM or SIGINT (exit status 0)."""
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        raise ValueError(f"the server needs FastAPI, uvicorn, sse-starlette and prometheus_client ({exc}); "
                         f"install them with: pip install \"ninfer_kv[serve]\"") from None
    from ..engine import LLM, AsyncLLMEngine

    if not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model!r}: no such directory (a Hugging Face checkpoint directory)")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes} is too small; allowed: at least 1024")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.profile, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, kv_capacity=args.kv_capacity, host_memory=args.host_memory,
              enable_prefix_caching=args.enable_prefix_caching, lease_growth=args.lease_growth, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens)
    name = args.served_model_name or args.model
    pages = llm.engine.store.pool("main").capacity
    app = create_app(AsyncLLMEngine(llm), served_model_name=name, api_key=api_key,
                     max_request_bytes=args.max_request_bytes, shutdown_grace=args.shutdown_grace)
    print(f"ninfer-kv serve: {name} (max_model_len {llm.engine.max_model_len}, max_num_seqs "
          f"{llm.engine.max_num_seqs}, {pages} KV pages) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", lifespan="on",
                            timeout_graceful_shutdown=int(args.shutdown_grace) + 10)
    # uvicorn answers SIGTERM with its graceful shutdown, then raises the signal again under the
    # handler that was in place before it started: this one, which exits with status 0 (so does a
    # SIGTERM that arrives before uvicorn took the signal over)
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return None


def _drained(signum, frame) -> None:
    """SIGTERM outside uvicorn's own handling (after its graceful shutdown): exit with status 0."""
    raise SystemExit(0)


register_subcommand(
    "serve",
    help="an OpenAI-compatible HTTP server on the engine (/v1/completions, /v1/chat/completions, /metrics)",
    configure=configure,
    run=run,
)
