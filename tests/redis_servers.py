"""Helpers for starting local `redis-server`s in cluster mode, shared by tests/test_redis_cluster.py and
scripts/bench_store.py (no pytest here: the benchmark imports it too)."""

from __future__ import annotations

import random
import socket


def cluster_ports(n: int) -> list[int]:
    """`n` free ports whose cluster bus ports (port + 10000, which must stay below 65536) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(20000, 50000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        if port not in ports:
            ports.append(port)
    return ports
