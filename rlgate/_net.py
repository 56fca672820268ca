"""Loopback helpers for the processes the demo, the benchmarks and the tests start: a free TCP port, and a raw
server for hand-written upstreams."""

from __future__ import annotations

import contextlib
import socket
import threading


def free_port() -> int:
    """A port nothing listens on now (the OS's choice); another process may take it before it is bound."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """A raw TCP server on a free loopback port for the benchmarks' and tests' hand-written upstreams: each
    connection is served by `serve(conn)` on a thread of its own; `url` is its OpenAI base URL."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the client hung up
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()


def read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 request from `conn`: its head (request line and headers) and its body of Content-Length
    bytes; None when the client closed the connection before all of it came."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(65536)
        if not data:
            return None
        head += data
    head, body = head.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        data = conn.recv(1 << 20)
        if not data:
            return None
        body += data
    return head, body[:length]
