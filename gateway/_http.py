"""A lean HTTP/1.1 client for one upstream origin: keep-alive connections as asyncio protocols, responses
parsed by httptools (llhttp, the parser uvicorn uses).

Why not aiohttp: on the gateway's hot path aiohttp's per-request machinery (request and response objects,
a timer context, a stream reader, header multidicts, URL handling) cost ~0.1 ms of CPU per call, about a
sixth of the gateway's whole budget at concurrency 1; this client does one `transport.write` per
request and resolves one future per wait (scripts/bench_http_clients.py measures both side by side).

What it does, and no more, because the gateway talks to one known kind of server (vLLM's uvicorn, or an
OpenAI-compatible HTTPS endpoint):
  * one origin (http or https), a pool of at most `limit` connections, most recently used first, idle
    ones dropped after `keepalive_s` (below uvicorn's 5 s keep-alive, so the server rarely closes a
    connection under us);
  * a request whose reused connection is found closed before any byte of the answer arrived is sent
    once more on a fresh connection (the server closed it idle: it never saw the request);
  * bodies by content-length, chunked, or until the connection closes; read whole or as they arrive,
    with reading paused while more than `_HIGH_WATER` bytes wait for a slow consumer;
  * one deadline per request (connect, send, headers and body): past it the connection is closed and
    the waiting caller gets `TimeoutError`; other failures raise `HTTPError`;
  * a response not read to its end closes its connection on release (a stream the agent hung up on is
    then aborted by the server), one read to its end goes back to the pool.

What it does not do: go through a proxy. An `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY` that applies to the
origin (not bypassed by `NO_PROXY`) is named in `ignored_proxy`, which the gateway logs at start. TLS
verification uses OpenSSL's default trust store, which `SSL_CERT_FILE` and `SSL_CERT_DIR` replace.
"""

from __future__ import annotations

import asyncio
import collections
import os
import ssl as ssl_module
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies_environment, proxy_bypass_environment  # type: ignore[attr-defined]  # not in typeshed

import httptools

_HIGH_WATER = 1 << 18  # bytes buffered for a consumer before reading from the socket pauses
_LOW_WATER = 1 << 16


class HTTPError(Exception):
    """The connection failed, broke, or carried something that is not HTTP."""


class BodyTooLarge(Exception):
    """`Response.read(limit)`: the body is over `limit` bytes (by its Content-Length, or as it arrived);
    its connection is closed, what had arrived is dropped."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        super().__init__(f"the answer is over {limit} bytes" + (f" ({size} announced)" if size else ""))
        self.limit = limit
        self.size = size


class Response:
    """An answer whose status line and headers have arrived; its body is read with `read()` or
    `chunks()`."""

    __slots__ = (
        "status",
        "headers",
        "_conn",
        "_buffer",
        "_buffered",
        "_complete",
        "_error",
        "_whole",
        "_limit",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # names in lower case; a repeated header keeps its last value
        self._conn = conn
        self._buffer: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._whole = False  # read() wants the whole body: reading never pauses for it
        self._limit: int | None = None  # read(limit): the most bytes the body may have

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; with `limit`, `BodyTooLarge` as soon as it is known to be longer (the bytes
        past it are never read into memory)."""
        self._whole = True
        if limit is not None:
            announced = self.headers.get("content-length", "")
            if announced.isdigit() and int(announced) > limit:
                self._conn.close()
                raise BodyTooLarge(limit, int(announced))
            if self._buffered > limit:  # already in (even all of it): refused all the same
                self._drop(limit)
                raise BodyTooLarge(limit)
            self._limit = limit
        self._conn.resume(force=True)
        while not self._complete:
            await self._wait()
        data = b"".join(self._buffer) if len(self._buffer) != 1 else self._buffer[0]
        self._buffer.clear()
        self._buffered = 0
        return data

    def _drop(self, limit: int) -> None:
        self._buffer.clear()
        self._buffered = 0
        self._conn._fail(BodyTooLarge(limit))
        self._conn.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything buffered so far, each time."""
        while True:
            if self._buffer:
                data = b"".join(self._buffer) if len(self._buffer) != 1 else self._buffer[0]
                self._buffer.clear()
                self._buffered = 0
                self._conn.resume()
                yield data
            elif self._complete:
                return
            else:
                await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        await self._conn.wait()
        if self._error is not None and not self._buffer:
            raise self._error


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.keep_alive = True
        self.received = False  # any byte of the current answer
        self.headers_done = False
        self.reading_paused = False
        self.idle_since = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes on an idle connection: not a server to keep talking to
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HTTPError(f"malformed HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        response = self.response
        if response is not None and not response._complete:
            if exc is None and self.headers_done and _until_close(response.headers):
                response._complete = True  # a body delimited by the end of the connection
                self._wake()
            else:
                self._fail(HTTPError("the server closed the connection" + (f": {exc}" if exc else "")))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        if response._error is not None:  # over its limit already: the rest is not kept
            return
        response._buffer.append(body)
        response._buffered += len(body)
        if response._limit is not None and response._buffered > response._limit:
            response._drop(response._limit)
            return
        if (
            response._buffered > _HIGH_WATER
            and not response._whole
            and not self.reading_paused
            and self.transport is not None
        ):
            self.transport.pause_reading()
            self.reading_paused = True
        self._wake()

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._complete = True
            self._wake()

    # -- used by the pool and the response

    def start(self, data: bytes, deadline: float | None) -> Response:
        self.response = response = Response(self)
        self.received = self.headers_done = False
        if not self.usable():  # closed since it was released: the request fails unsent (and is retried)
            response._error = HTTPError("the server closed the connection")
            return response
        if deadline is not None:
            self.timer = self.loop.call_at(deadline, self._timed_out)
        assert self.transport is not None  # usable()
        self.transport.write(data)
        return response

    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def resume(self, force: bool = False) -> None:
        response = self.response
        if self.reading_paused and response is not None and (force or response._buffered < _LOW_WATER):
            self.reading_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def finish(self) -> bool:
        """End of the request: True if the connection can carry another one."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        response, self.response = self.response, None
        reusable = (
            response is not None
            and response._complete
            and response._error is None
            and self.keep_alive
            and self.usable()
        )
        if not reusable:
            self.close()
        return reusable

    def close(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.close()
        self.lost = True

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.response is not None and self.response._error is None:
            self.response._error = exc
        self._wake()

    def _timed_out(self) -> None:
        self.timer = None
        self._fail(TimeoutError())
        self.close()


def _until_close(headers: dict[str, str]) -> bool:
    return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower()


def environment_proxy(scheme: str, host: str, port: int) -> str | None:
    """The name of the proxy variable the environment sets for this origin (as urllib reads them: the
    scheme's own, else ALL_PROXY, the lowercase name first; unless NO_PROXY bypasses the host), or None."""
    proxies = getproxies_environment()
    if not (proxies.get(scheme) or proxies.get("all")) or proxy_bypass_environment(f"{host}:{port}", proxies):
        return None
    kind = scheme if proxies.get(scheme) else "all"
    for name in (f"{kind}_proxy", f"{kind.upper()}_PROXY"):
        if os.environ.get(name):
            return name
    return f"{kind.upper()}_PROXY"


class Client:
    """Requests to one origin (`base_url`'s scheme, host and port; its path prefixes every request)."""

    def __init__(
        self,
        base_url: str,
        *,
        limit: int = 256,
        timeout_s: float | None = 600.0,
        connect_timeout_s: float = 10.0,
        keepalive_s: float = 4.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl_module.SSLContext | None = (
            ssl_module.create_default_context() if parts.scheme == "https" else None
        )
        self.ignored_proxy = environment_proxy(parts.scheme, self.host, self.port)
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self._host_header = host if default_port else f"{host}:{self.port}"
        self.limit = limit
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode("latin-1")
        self._heads: dict[tuple[str, str], bytes] = {}
        self._idle: list[_Connection] = []
        self._open = 0  # connections open or opening
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self._closed = False

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        timeout_s: float | None = None,
        prefixed: bool = True,
    ) -> AsyncIterator[Response]:
        """A response whose headers have arrived; read its body inside the block. `prefixed=False`: `path`
        is the whole path, without the base URL's."""
        loop = asyncio.get_running_loop()
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if limit is None else loop.time() + limit
        data = self._head(method, self.prefix + path if prefixed else path, body) + (body or b"")
        conn, response = await self._send(loop, data, deadline)
        try:
            yield response
        finally:
            self._release(conn)

    async def aclose(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(HTTPError("the client is closed"))

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    @property
    def open_connections(self) -> int:
        return self._open

    # -- internals

    def _head(self, method: str, target: str, body: bytes | None) -> bytes:
        """The request's head; `target` is the whole path (the base URL's prefix included)."""
        head = self._heads.get((method, target))
        if head is None:
            head = self._heads[(method, target)] = (
                f"{method} {target} HTTP/1.1\r\nHost: {self._host_header}\r\n".encode("latin-1") + self._fixed
            )
        if body is None:
            return head + b"\r\n"
        return head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"

    async def _send(
        self, loop: asyncio.AbstractEventLoop, data: bytes, deadline: float | None
    ) -> tuple[_Connection, Response]:
        for attempt in (0, 1):
            conn, reused = await self._acquire(loop, deadline)
            try:
                response = conn.start(data, deadline)
                while not conn.headers_done:
                    await response._wait()
            except HTTPError:
                conn.finish()
                self._forget(conn)
                if reused and attempt == 0 and not conn.received:
                    continue  # closed while idle, before it saw this request: once more, on a new one
                raise
            except BaseException:
                conn.finish()
                self._forget(conn)
                raise
            return conn, response
        raise AssertionError("unreachable")

    async def _acquire(
        self, loop: asyncio.AbstractEventLoop, deadline: float | None
    ) -> tuple[_Connection, bool]:
        if self._closed:
            raise HTTPError("the client is closed")
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable() and now - conn.idle_since < self.keepalive_s:
                return conn, True
            conn.close()
            self._open -= 1
        while self._open >= self.limit:
            waiter: asyncio.Future[_Connection | None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                if deadline is None:
                    handed = await waiter
                else:  # the request's deadline covers waiting for a connection too
                    async with asyncio.timeout_at(deadline):
                        handed = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    handed = waiter.result()
                    if handed is not None:
                        self._release_to_pool(handed)  # handed over just as we were cancelled
                    else:
                        self._wake_waiter()  # a free slot we cannot use: the next waiter's
                else:
                    _discard(self._waiters, waiter)
                raise
            if handed is not None:
                if handed.usable():
                    return handed, True
                handed.close()  # closed since it was released: its slot is ours to reopen
                self._open -= 1
        self._open += 1
        try:
            timeout = (
                self.connect_timeout_s
                if deadline is None
                else min(self.connect_timeout_s, max(0.0, deadline - loop.time()))
            )
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                )
        except BaseException as exc:
            self._open -= 1
            self._wake_waiter()
            if isinstance(exc, TimeoutError):
                raise
            if isinstance(exc, OSError):
                raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
            raise
        return conn, False

    def _release(self, conn: _Connection) -> None:
        if conn.finish():
            self._release_to_pool(conn)
        else:
            self._forget(conn)

    def _release_to_pool(self, conn: _Connection | None) -> None:
        if conn is None:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        if self._closed:
            conn.close()
            self._open -= 1
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        """A connection that is closed for good: its place in the pool goes to a waiter, if any."""
        self._open -= 1
        self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # no connection handed over: it may open one
                return


def _discard(items: collections.deque[Any], item: Any) -> None:
    try:
        items.remove(item)
    except ValueError:
        pass
