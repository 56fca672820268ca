"""Prometheus metrics of the gateway, on a registry of its own (served at GET /metrics).

With several worker processes (`workers` > 1, `gateway.server`) each worker calls `share_across_processes`
before it builds its metrics: prometheus_client's multiprocess mode, every value in a memory-mapped file
of the worker's in a directory the supervisor creates (and removes at exit), and `/metrics`, whichever
worker answers it, sums the files of all workers (`MultiProcessCollector`), dead ones' counters included.
What is read at scrape time in one process (the upstream pool, the record connection) becomes metrics of
each worker's own, copied from its live values every `SYNC_INTERVAL_S` (`sync_forever`) and when it
answers a scrape; their gauges sum the live workers only (`livesum`: the supervisor calls
`mark_process_dead` when a worker exits)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STORE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)
log = structlog.get_logger("rlgate.gateway")
SYNC_INTERVAL_S = 1.0
_shared_dir: str | None = None  # this process's multiprocess directory, once `share_across_processes` ran


def share_across_processes(directory: str) -> None:
    """Put this process's metrics into prometheus_client's multiprocess mode, writing into `directory`;
    call it in a worker before its `GatewayMetrics` is built. The mode is prometheus_client's own and
    process-wide: its value class is chosen from PROMETHEUS_MULTIPROC_DIR, read where it creates a
    worker's files."""
    global _shared_dir
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.get_value_class()
    _shared_dir = directory


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # what GET /metrics serves
        self._live: list[Callable[[], None]] = []  # copies of scrape-time values (multiprocess mode)
        own: CollectorRegistry | None = self.registry
        if _shared_dir is not None:  # the metrics below write to files; /metrics reads every worker's
            own = None
            self.registry.register(_Sync(self))  # this worker's copies first, then all workers' files
            MultiProcessCollector(self.registry, path=_shared_dir)
        self.calls = Counter(
            "rlgate_gateway_calls",
            "Calls handled, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=own,
        )
        self.latency = Histogram(
            "rlgate_gateway_call_latency_seconds",
            "Request to complete answer.",
            ["endpoint", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.tokens = Counter("rlgate_gateway_tokens", "Tokens of recorded calls.", ["kind"], registry=own)
        self.errors = Counter("rlgate_gateway_errors", "Errors by kind.", ["kind"], registry=own)
        self.store_latency = Histogram(
            "rlgate_gateway_store_latency_seconds",
            "Time to commit a call to Redis.",
            buckets=_STORE_BUCKETS,
            registry=own,
        )
        self.prompt_tokens = self.tokens.labels("prompt")
        self.completion_tokens = self.tokens.labels("completion")

    def watch(
        self, upstream_connections: Callable[[], tuple[int, int]], record_stats: Callable[[], dict[str, int]]
    ) -> None:
        """Export the upstream pool and the Redis record connection, read when scraped (nothing on the hot
        path): `upstream_connections()` gives (open, idle), `record_stats()` the record connection's
        counters."""
        if _shared_dir is None:
            self.registry.register(_Connections(upstream_connections, record_stats))
            return
        pool = Gauge(
            "rlgate_gateway_upstream_connections",
            _Connections.POOL_HELP,
            ["state"],
            registry=None,
            multiprocess_mode="livesum",
        )
        in_flight = Gauge(
            "rlgate_gateway_record_in_flight",
            _Connections.IN_FLIGHT_HELP,
            registry=None,
            multiprocess_mode="livesum",
        )
        counters = {
            stat: Counter(f"rlgate_gateway_record_{stat}", help_text, registry=None)
            for stat, help_text in _Connections.COUNTER_HELP.items()
        }
        copied = dict.fromkeys(counters, 0)

        def copy() -> None:
            open_, idle = upstream_connections()
            pool.labels("open").set(open_)
            pool.labels("idle").set(idle)
            stats = record_stats()
            in_flight.set(stats["in_flight"])
            for stat, counter in counters.items():
                if stats[stat] > copied[stat]:
                    counter.inc(stats[stat] - copied[stat])
                    copied[stat] = stats[stat]

        self._live.append(copy)

    def sync(self) -> None:
        """Copy the scrape-time values into this worker's files (multiprocess mode; else nothing)."""
        for copy in self._live:
            copy()

    async def sync_forever(self, interval_s: float = SYNC_INTERVAL_S) -> None:
        """`sync` every `interval_s`, so that a scrape answered by another worker sees this one's values."""
        while True:
            try:
                self.sync()
            except Exception as exc:  # stale metrics, not a dead gateway
                log.warning("metrics_sync_failed", error=str(exc)[:200])
            await asyncio.sleep(interval_s)


class _Sync:
    """Registered first in multiprocess mode: a scrape copies the answering worker's live values."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        self.metrics.sync()
        return iter(())


class _Connections:
    POOL_HELP = "Connections to the inference server, by state."
    IN_FLIGHT_HELP = "Record commands waiting for Redis's reply."
    COUNTER_HELP = {
        "connects": "Connections the record path opened to Redis (more than one: Redis dropped one).",
        "commands": "Commands the record path sent to Redis (the record "
        "script; a script load after Redis lost its scripts).",
        "writes": "Socket writes that carried them (commands / writes = the mean group-commit batch).",
    }

    def __init__(
        self, upstream_connections: Callable[[], tuple[int, int]], record_stats: Callable[[], dict[str, int]]
    ) -> None:
        self.upstream_connections = upstream_connections
        self.record_stats = record_stats

    def collect(self) -> Iterator[Metric]:
        open_, idle = self.upstream_connections()
        pool = GaugeMetricFamily("rlgate_gateway_upstream_connections", self.POOL_HELP, labels=["state"])
        pool.add_metric(["open"], open_)
        pool.add_metric(["idle"], idle)
        yield pool
        stats = self.record_stats()
        for stat, help_text in self.COUNTER_HELP.items():
            yield CounterMetricFamily(f"rlgate_gateway_record_{stat}", help_text, value=stats[stat])
        yield GaugeMetricFamily(
            "rlgate_gateway_record_in_flight", self.IN_FLIGHT_HELP, value=stats["in_flight"]
        )
