"""``ninfer-kv serve``: an OpenAI-compatible HTTP server on the engine (:mod:`ninfer_kv.engine`).

* :mod:`.cli` — the subcommand (flags with vLLM's names; ``pip install "ninfer_kv[serve]"``);
* :mod:`.app` — :func:`create_app`: the FastAPI application over an
  :class:`~ninfer_kv.engine.AsyncLLMEngine` (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/reset_prefix_cache``);
* :mod:`.protocol` — the OpenAI request and response bodies (pydantic);
* :mod:`.generation` — engine requests in, OpenAI choices, deltas and usage out;
* :mod:`.guard` — the API key and the body limit, before anything else runs;
* :mod:`.errors` — the OpenAI error shape for every refusal;
* :mod:`.limits` — the default body limit and shutdown grace;
* :mod:`.metrics` — Prometheus metrics (``prometheus_client``).

docs/SERVER.md describes the server.  Importing this package imports none of FastAPI, uvicorn or JAX.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
