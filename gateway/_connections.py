"""Slow and malicious clients: read deadlines, a header size limit and a connection cap on every listener.

uvicorn's httptools protocol has a keep-alive timer between requests and nothing else: a socket that never
sends its headers, or never finishes its body, stays open for good, and headers of any size are buffered.
`GuardedProtocol` is that protocol with these added (one per listener, through `Listener.protocol`):

| limit | counted from | on expiry |
|---|---|---|
| headers in within `header_timeout_s` | connection open; the first byte of each later request | 408 if a request had begun, then close |
| body in within `body_timeout_s` + 1 s per `body_min_bytes_per_s` bytes received (Apache mod_reqtimeout's MinRate), at most `body_timeout_s + max_body_bytes / body_min_bytes_per_s` | headers complete | 408 if no answer had started, then close |
| request line and headers at most `max_header_bytes` | | 431, then close |
| at most `max_connections` open on the listener | | a new connection closes the oldest one that has no whole request in service (still sending its headers or body, or idle between requests); when every one has, the new one is closed |

The cap makes room rather than answering 503 (uvicorn's `limit_concurrency`): once slow sockets fill a
503 cap, every request gets 503, agents' included, on their kept-alive connections too; here a socket that
never completes a request is always the first to go, and a request in service is never cut.

A request that arrives in one read arms no timer of its own: the header deadline of a connection's first
request is armed when it opens, and a later request's only when it spans several reads. Time spent
serving a request (the upstream call) is not limited here, nor is the client's reading of the answer.
"""

from __future__ import annotations

import functools
import time
from asyncio import TimerHandle, Transport
from dataclasses import dataclass
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = structlog.get_logger("rlgate.gateway")

_HEADERS, _BODY, _IDLE = 0, 1, 2  # where the parser is in the current request
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    """One listener's limits: the gateway settings of the same names."""

    header_timeout_s: float
    body_timeout_s: float
    body_min_bytes_per_s: float
    max_body_bytes: int
    max_header_bytes: int
    max_connections: int


class Listener:
    """One listening port: its limits, its open connections, and those that may be closed to make room
    (insertion-ordered, so the first is the one that has waited longest without a request in service)."""

    def __init__(self, name: str, limits: ConnectionLimits) -> None:
        self.name = name
        self.limits = limits
        self.open: set[GuardedProtocol] = set()
        self.idle: dict[GuardedProtocol, None] = {}
        self._closed = {
            "header_timeout": 0,
            "body_timeout": 0,
            "header_too_large": 0,
            "evicted": 0,
            "refused": 0,
        }
        self._logged_at = 0.0

    def protocol(self) -> Any:
        """The protocol factory to give uvicorn's Config as `http=`."""
        return functools.partial(GuardedProtocol, listener=self)

    def admit(self, conn: GuardedProtocol) -> bool:
        """Count a new connection in; above the cap, close the oldest idle one, or refuse this one."""
        self.open.add(conn)
        self.idle[conn] = None
        while len(self.open) > self.limits.max_connections:
            oldest = next(iter(self.idle))
            self.forget(oldest)
            if oldest is conn:
                self.note("refused")
                return False
            self.note("evicted")
            oldest.drop(None)
        return True

    def forget(self, conn: GuardedProtocol) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def note(self, reason: str) -> None:
        """Count a connection closed for `reason`; log the totals at most every 10 s (an attack closes
        thousands)."""
        self._closed[reason] += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            log.warning("connections_closed", listener=self.name, open=len(self.open), **self._closed)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the listener's deadlines, header size limit and connection cap."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: Any = None,
        *,
        listener: Listener,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._listener = listener
        self._limits = listener.limits
        self._phase = _HEADERS
        self._header_bytes = 0
        self._deadline: TimerHandle | None = None
        self._body_due = self._body_latest = 0.0
        rate = self._limits.body_min_bytes_per_s
        self._s_per_byte = 1.0 / rate if rate > 0 else 0.0

    # connection

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]  # a stream's: a Transport
        super().connection_made(transport)
        if not self._listener.admit(self):
            transport.close()
            return
        self._deadline = self.loop.call_later(self._limits.header_timeout_s, self._expire)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._listener.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase == _BODY:
            self._body_due += len(data) * self._s_per_byte
        else:
            if phase == _IDLE:  # the first bytes of the next request
                self._phase = _HEADERS
            size = self._header_bytes + len(data)
            if size > self._limits.max_header_bytes and not self._headers_fit(data):
                self._listener.note("header_too_large")
                self.drop(431)
                return
            self._header_bytes = size
        super().data_received(data)
        if self._deadline is None and self._phase != _IDLE:  # still reading a request after this read
            self._arm()

    def _headers_fit(self, data: bytes) -> bool:
        """Whether the headers end within the limit in `data` (which may also carry the body)."""
        end = data.find(b"\r\n\r\n")
        if end < 0 and data.startswith((b"\n", b"\r\n")):
            end = 0  # the blank line began in the previous read
        return end >= 0 and self._header_bytes + end + 4 <= self._limits.max_header_bytes

    # parser callbacks

    def on_headers_complete(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = _BODY
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _IDLE
        self._header_bytes = 0
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if not self.cycle.response_complete:
            self._listener.idle.pop(self, None)  # a whole request in service: never closed to make room

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if not pipelined:
            self._listener.idle[self] = None
        if self._deadline is None and self._phase != _IDLE:  # reading again after a pipelined request
            self._arm()

    # deadlines

    def _arm(self) -> None:
        """Start the deadline of the part of the request now due, unless reading is paused (a pipelined
        request waits for the one before it) or the connection is closing."""
        if self.flow.read_paused or self.transport.is_closing():
            return
        limits = self._limits
        if self._phase == _HEADERS:
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._expire)
        else:
            self._arm_body()

    def _arm_body(self) -> None:
        limits = self._limits
        self._body_due = self.loop.time() + limits.body_timeout_s
        self._body_latest = self._body_due + limits.max_body_bytes * self._s_per_byte
        self._deadline = self.loop.call_at(self._body_due, self._expire)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._phase == _BODY:
            if self.flow.read_paused:  # the app has not asked for the body yet (a call held for the
                # backlog, say): the wait is the server's, not the client's; its full time starts again
                self._arm_body()
                return
            due = min(self._body_due, self._body_latest)
            if due > self.loop.time():  # the body kept coming at the minimum rate: later
                self._deadline = self.loop.call_at(due, self._expire)
                return
            self._listener.note("body_timeout")
            self.drop(408 if self.cycle is not None and not self.cycle.response_started else None)
        else:
            self._listener.note("header_timeout")
            self.drop(408 if self._header_bytes else None)

    def drop(self, status: int | None) -> None:
        """Close the connection, first answering `status` (408 or 431) when given."""
        self._cancel()
        transport = self.transport
        if transport.is_closing():
            return
        if transport.get_write_buffer_size():
            transport.abort()  # it does not read its answers either: nothing more to flush to it
            return
        if status is not None:
            transport.write(_ANSWERS[status])
        transport.close()


def _answer(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


_ANSWERS = {
    408: _answer(408, "Request Timeout", "Request not received in time."),
    431: _answer(431, "Request Header Fields Too Large", "Request header fields too large."),
}
