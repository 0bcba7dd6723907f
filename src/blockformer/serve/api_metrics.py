"""``/metrics``: the engine's counters and the API's latencies in Prometheus' text format.

Each app has its own ``CollectorRegistry`` (two servers in one process, or a test that
builds many apps, never share or clash). The engine's numbers are read from
``aeng.stats()`` at scrape time, so they cannot drift from the engine; latencies are
measured here, per request, from the moment the HTTP layer receives it: time to the first
token, time per output token after it, and end to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "blockformer_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Gauges and counters straight from ``EngineStats``, plus generation tokens per second
    averaged over the time since the previous scrape."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self.stats = stats
        self.last = (time.monotonic(), 0)

    def collect(self):
        s = self.stats()
        gauges = {
            "requests_waiting": ("requests queued for the engine", s.waiting),
            "requests_running": ("requests in the engine's running batch", s.running),
            "kv_blocks_total": ("KV-cache blocks in the pool", s.blocks_total),
            "kv_blocks_used": ("KV-cache blocks held by requests or the prefix cache", s.blocks_used),
            "kv_blocks_free": ("KV-cache blocks free", s.blocks_free),
            "prefix_cache_hit_rate": ("prompt tokens found in the prefix cache / prompt tokens looked up",
                                      s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0),
            "generation_tokens_per_second": ("generated tokens per second since the previous scrape",
                                             self._rate(s.generation_tokens_total)),
        }
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, text, value=value)
        counters = {
            "prompt_tokens": ("prompt tokens prefilled", s.prompt_tokens_total),
            "generation_tokens": ("tokens generated", s.generation_tokens_total),
            "preemptions": ("requests preempted to free KV blocks", s.preempted_total),
            "engine_steps": ("engine steps run", s.steps_total),
            "prefix_cache_queried_tokens": ("prompt tokens looked up in the prefix cache", s.prefix_queried_tokens),
            "prefix_cache_hit_tokens": ("prompt tokens found in the prefix cache", s.prefix_hit_tokens),
        }
        for name, (text, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, text, value=value)

    def _rate(self, tokens: int) -> float:
        t0, n0 = self.last
        t1 = time.monotonic()
        self.last = (t1, tokens)
        return (tokens - n0) / (t1 - t0) if t1 > t0 else 0.0


class ApiMetrics:
    """The registry of one app; ``track()`` times one request."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "requests finished, by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.errors = Counter(PREFIX + "http_errors", "requests refused, by HTTP status", ["status"],
                              registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time from the request to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "time per token after the first",
                              buckets=TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "time from the request to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats))

    def track(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Stamps a request's first and last token; ``finish`` records it once."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.done = False

    def tokens_made(self, n: int) -> None:
        if n:
            self.last = time.monotonic()
            self.first = self.first or self.last
            self.tokens += n

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.requests.labels(finish_reason=reason).inc()
        m.e2e.observe(time.monotonic() - self.start)
        if self.first is not None:
            m.ttft.observe(self.first - self.start)
            if self.tokens > 1:
                m.tpot.observe((self.last - self.first) / (self.tokens - 1))
