"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Gauges are read from the engine when scraped (requests running and waiting, pages used and held per
pool, Host tier bytes); counters and histograms are recorded as requests are served (prompt,
generated and prefix-cache hit tokens, finished requests by finish reason, time to first token,
inter-token latency).  Each server has its own registry.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Every metric of one server (module docstring)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("ninfer_kv_requests_running", "Requests with running sequences.", registry=r)
        self.waiting = Gauge("ninfer_kv_requests_waiting", "Requests in the queue.", registry=r)
        self.pages_used = Gauge("ninfer_kv_pages_used", "Pages leased or reserved (cached prefixes included).",
                                ["pool"], registry=r)
        self.pages_capacity = Gauge("ninfer_kv_pages_capacity", "Pages of the pool.", ["pool"], registry=r)
        self.host_bytes = Gauge("ninfer_kv_host_tier_bytes", "Bytes of offloaded prefixes in the Host tier.",
                                registry=r)
        self.prompt_tokens = Counter("ninfer_kv_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("ninfer_kv_generation_tokens", "Tokens generated and sent to clients.", registry=r)
        self.cache_hit_tokens = Counter("ninfer_kv_prefix_cache_hit_tokens",
                                        "Prompt tokens reused from the prefix cache.", registry=r)
        self.requests = Counter("ninfer_kv_requests", "Finished completions (one per choice) by finish reason; a client that left counts as abort.", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("ninfer_kv_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ninfer_kv_inter_token_latency_seconds", "Time between a sequence's tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def refresh(self, stats: dict) -> None:
        """Set the gauges from :meth:`~ninfer_kv.engine.AsyncLLMEngine.stats`."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        for pool, (used, capacity) in stats["pages"].items():
            self.pages_used.labels(pool=pool).set(used)
            self.pages_capacity.labels(pool=pool).set(capacity)
        self.host_bytes.set(stats["host_bytes"])

    def finished(self, prompt_tokens: int, cached_tokens: int, reasons: list[str | None]) -> None:
        """Count a finished request."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_hit_tokens.inc(cached_tokens)
        for reason in reasons:
            self.requests.labels(finish_reason=reason or "none").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
