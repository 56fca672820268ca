"""Prometheus metrics of the gateway, on a registry of its own (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STORE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter("rlgate_gateway_calls", "Calls handled, by endpoint and outcome.",
                             ["endpoint", "outcome"], registry=self.registry)
        self.latency = Histogram("rlgate_gateway_call_latency_seconds", "Request to complete answer.",
                                 ["endpoint", "stream"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("rlgate_gateway_tokens", "Tokens of recorded calls.", ["kind"],
                              registry=self.registry)
        self.errors = Counter("rlgate_gateway_errors", "Errors by kind.", ["kind"], registry=self.registry)
        self.store_latency = Histogram("rlgate_gateway_store_latency_seconds", "Time to commit a call to Redis.",
                                       buckets=_STORE_BUCKETS, registry=self.registry)
        self.prompt_tokens = self.tokens.labels("prompt")
        self.completion_tokens = self.tokens.labels("completion")
