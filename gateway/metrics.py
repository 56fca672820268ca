"""Prometheus metrics of the gateway, on a registry of its own (served at GET /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STORE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "rlgate_gateway_calls",
            "Calls handled, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rlgate_gateway_call_latency_seconds",
            "Request to complete answer.",
            ["endpoint", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "rlgate_gateway_tokens", "Tokens of recorded calls.", ["kind"], registry=self.registry
        )
        self.errors = Counter("rlgate_gateway_errors", "Errors by kind.", ["kind"], registry=self.registry)
        self.store_latency = Histogram(
            "rlgate_gateway_store_latency_seconds",
            "Time to commit a call to Redis.",
            buckets=_STORE_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = self.tokens.labels("prompt")
        self.completion_tokens = self.tokens.labels("completion")

    def watch(
        self, upstream_connections: Callable[[], tuple[int, int]], record_stats: Callable[[], dict[str, int]]
    ) -> None:
        """Export the upstream pool and the Redis record connection, read when scraped (nothing on the hot
        path): `upstream_connections()` gives (open, idle), `record_stats()` the record connection's
        counters."""
        self.registry.register(_Connections(upstream_connections, record_stats))


class _Connections:
    def __init__(
        self, upstream_connections: Callable[[], tuple[int, int]], record_stats: Callable[[], dict[str, int]]
    ) -> None:
        self.upstream_connections = upstream_connections
        self.record_stats = record_stats

    def collect(self) -> Iterator[Metric]:
        open_, idle = self.upstream_connections()
        pool = GaugeMetricFamily(
            "rlgate_gateway_upstream_connections",
            "Connections to the inference server, by state.",
            labels=["state"],
        )
        pool.add_metric(["open"], open_)
        pool.add_metric(["idle"], idle)
        yield pool
        stats = self.record_stats()
        yield CounterMetricFamily(
            "rlgate_gateway_record_connects",
            "Connections the record path opened to Redis (more than one: Redis dropped one).",
            value=stats["connects"],
        )
        yield CounterMetricFamily(
            "rlgate_gateway_record_commands",
            "Commands the record path sent to Redis (the record "
            "script; a script load after Redis lost its scripts).",
            value=stats["commands"],
        )
        yield CounterMetricFamily(
            "rlgate_gateway_record_writes",
            "Socket writes that carried them (commands / writes = the mean group-commit batch).",
            value=stats["writes"],
        )
        yield GaugeMetricFamily(
            "rlgate_gateway_record_in_flight",
            "Record commands waiting for Redis's reply.",
            value=stats["in_flight"],
        )
