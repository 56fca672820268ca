"""A free TCP port on loopback, for the processes the demo, the benchmarks and the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS's choice); another process may take it before it is bound."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
