"""An end-to-end serving demo over the KV store: ``ninfer-kv demo``.

A small Qwen-style model (:mod:`ninfer_kv.models.decoder`) or a Hugging Face checkpoint serves a
workload of requests that share system prompts through the public engine (:mod:`ninfer_kv.engine`):
admission by entitlement, chunked prefill, batch buckets, token-granular prefix reuse with COW
tails, memory pressure handled by offloading cold prefixes to the Host tier, optional MTP
speculative decoding, ``kv_lease_growth`` and data-parallel meshes; afterwards every request is
checked against a dense no-cache recomputation.

Modules: ``config`` (:class:`DemoConfig`, the demo models), ``requests`` (workload),
``checkpoint_cache`` (checkpoint directories read once), ``drafter`` (demo model parameters, MTP
head calibration), ``mesh`` (what a device mesh can serve), ``serve`` (the workload through the
engine), ``dense_check``, ``summary`` (the run's statistics, table and JSON), ``progress`` (progress
bar, compile clock), ``run`` (:func:`run_demo`: one run), ``cli`` (the subcommand).

The names below are imported on first use, so ``import ninfer_kv.demo.cli`` (done by every
``ninfer-kv`` invocation) stays cheap.
"""

from __future__ import annotations

import importlib

__all__ = [
    "DemoConfig",
    "DemoResult",
    "run_demo",
    "validate",
    "MODELS",
    "SPECULATIVE_METHODS",
    "WorkloadSpec",
    "Request",
    "make_workload",
]

_HOME = {
    "DemoConfig": "config",
    "run_demo": "run",
    "validate": "run",
    "MODELS": "config",
    "SPECULATIVE_METHODS": "config",
    "DemoResult": "summary",
    "WorkloadSpec": "requests",
    "Request": "requests",
    "make_workload": "requests",
}


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
