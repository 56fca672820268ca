"""Helpers for starting local `redis-server`s: their command line, a private one (`private_redis`, for tests
that change its settings or flags), and ports for cluster mode, shared by the tests and
scripts/bench_store.py (no pytest here: the benchmark imports it too)."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Iterator

import redis


def redis_server_command(port: int, *flags: str) -> list[str]:
    """The command line of a `redis-server` on 127.0.0.1:`port` without persistence, `flags` added."""
    no_persistence = ["--save", "", "--appendonly", "no"]
    return ["redis-server", "--bind", "127.0.0.1", "--port", str(port), *no_persistence, *flags]


@contextlib.contextmanager
def private_redis(port: int, *flags: str) -> Iterator[redis.Redis]:
    """A `redis-server` of its own on `port` (no persistence, `flags` added), answering when entered,
    killed on exit; yields a client of it."""
    server = subprocess.Popen(redis_server_command(port, *flags), stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        yield client
    finally:
        server.kill()
        server.wait()


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
