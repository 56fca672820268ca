"""Group commit of the hot path's Lua script over one pipelined Redis connection of its own.

The gateway records every call with one EVALSHA. Through redis-py each costs a pool checkout, a pipeline
object, redis-py's Python command packing and its retry wrapper: about a quarter of the gateway's CPU per
call (measured with py-spy at concurrency 1). Here the calls share one connection in Redis's own
pipelining model: each caller appends a future to a FIFO and its packed command to a write buffer that
goes out in one write per event-loop iteration, or, when nothing is in flight, writes it at once (so a
batch grows with the load and a lone call waits for nothing, with no timer); replies, which Redis sends
in order, resolve the futures in order (parsed by hiredis, the C parser redis-py itself uses).

Failure rules, the same as before:
  * a caller that is cancelled while waiting does not cancel its write: the command was sent;
  * when the connection breaks, every caller waiting on it gets `redis.exceptions.ConnectionError`, and
    the next call opens a new connection;
  * a connection that answers nothing for `timeout_s` while commands wait is closed (a hung Redis), and
    its callers get `redis.exceptions.TimeoutError`: a caller waits at most about twice `timeout_s`;
  * NOSCRIPT (Redis restarted or its script cache was flushed): the script is loaded and the command
    sent again.
The connection parameters (host and port or unix path, database, user, password, TLS) are read from the
redis-py client the store was built with, so every URL the store accepts works here too.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import socket
import ssl as ssl_module
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis import exceptions as redis_exc


def pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP: an array of bulk strings (str as UTF-8, numbers as `repr`, like redis-py)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif not isinstance(arg, (bytes, bytearray, memoryview)):
            arg = repr(arg).encode()
        out.append(b"$%d\r\n" % len(arg))
        out.append(arg)
        out.append(b"\r\n")
    return b"".join(out)


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, counts: Pipeline) -> None:
        self.loop = loop
        self.counts = counts  # commands and writes, counted for the pipeline across its connections
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.lost = False
        self.replies = 0  # replies received so far: the watchdog's measure of progress
        self.watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending = self.pending
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(redis_exc.ConnectionError(f"redis protocol error: {exc}"))
                return
            if reply is False:
                return
            self.replies += 1
            if not pending:
                self.fail(redis_exc.ConnectionError("redis sent a reply nobody asked for"))
                return
            future = pending.popleft()
            if not future.done():
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail_pending(
            redis_exc.ConnectionError("the connection to redis was closed" + (f": {exc}" if exc else ""))
        )

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        if self.lost:
            future.set_exception(redis_exc.ConnectionError("the connection to redis was closed"))
            return future
        idle = not self.pending
        self.pending.append(future)
        self.counts.commands += 1
        if idle and not self.flush_scheduled and self.transport is not None:
            self.transport.write(packed)  # nothing in flight: no batch to wait for, out at once
            self.counts.writes += 1
        else:
            self.out.append(packed)
            if not self.flush_scheduled:
                self.flush_scheduled = True
                self.loop.call_soon(self._flush)
        if self.watchdog is None:
            self.watchdog = self.loop.call_later(self.timeout_s, self._check, self.replies)
        return future

    def fail(self, exc: Exception) -> None:
        """Close the connection; every waiting caller gets `exc`."""
        self.lost = True
        self._fail_pending(exc)
        if self.transport is not None:
            self.transport.abort()

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.lost or self.transport is None:
            return
        data = b"".join(self.out) if len(self.out) != 1 else self.out[0]
        self.out.clear()
        self.transport.write(data)
        self.counts.writes += 1

    def _check(self, replies_then: int) -> None:
        self.watchdog = None
        if not self.pending or self.lost:
            return
        if self.replies == replies_then:
            self.fail(redis_exc.TimeoutError(f"redis answered nothing for {self.timeout_s} s"))
        else:
            self.watchdog = self.loop.call_later(self.timeout_s, self._check, self.replies)

    def _fail_pending(self, exc: Exception) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        self.out.clear()
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(exc)


class Pipeline:
    """One lazily opened, pipelined connection to the Redis that `client` talks to."""

    def __init__(self, client: aioredis.Redis, timeout_s: float) -> None:
        pool = client.connection_pool
        self._kwargs = dict(pool.connection_kwargs)
        self._ssl = issubclass(pool.connection_class, aioredis.SSLConnection)
        self._timeout_s = timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._closed = False
        self.connects = 0  # connections opened so far (more than one: Redis dropped one)
        self.commands = 0  # commands sent, and the writes that carried them (for the batch size)
        self.writes = 0

    async def call(self, *args: Any) -> Any:
        """The reply to one command; a Redis error reply is returned as a `hiredis.ReplyError`."""
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connection()
        return await conn.call(pack(args))

    def stats(self) -> dict[str, int]:
        """Counters for metrics: connections opened, commands sent, the writes that carried them, and
        commands waiting for their reply now."""
        conn = self._conn
        in_flight = len(conn.pending) if conn is not None else 0  # a lost connection has failed them all
        return {
            "connects": self.connects,
            "commands": self.commands,
            "writes": self.writes,
            "in_flight": in_flight,
        }

    async def aclose(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.fail(redis_exc.ConnectionError("the store is shutting down"))
            self._conn = None

    async def _connection(self) -> _Connection:
        if self._closed:
            raise redis_exc.ConnectionError("the store is shutting down")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        # shield: one caller's cancellation must not abort the connection the others wait for
        return await asyncio.shield(self._connecting)

    def _connected(self, attempt: asyncio.Future[_Connection]) -> None:
        if self._connecting is attempt:  # the next caller after a failed attempt starts a new one
            self._connecting = None
        if not attempt.cancelled():
            attempt.exception()  # retrieved: a failure nobody waited for is not "never retrieved"

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        kw = self._kwargs
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                if kw.get("path"):
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(loop, self._timeout_s, self), kw["path"]
                    )
                else:
                    ssl = self._ssl_context() if self._ssl else None
                    _, conn = await loop.create_connection(
                        lambda: _Connection(loop, self._timeout_s, self),
                        kw.get("host", "localhost"),
                        int(kw.get("port", 6379)),
                        ssl=ssl,
                    )
                hello = []
                if kw.get("password") is not None:
                    user = kw.get("username")
                    hello.append(("AUTH", user, kw["password"]) if user else ("AUTH", kw["password"]))
                if int(kw.get("db") or 0):
                    hello.append(("SELECT", int(kw["db"])))
                for reply in await asyncio.gather(*(conn.call(pack(c)) for c in hello)):
                    if isinstance(reply, hiredis.ReplyError):  # wrong password, no such database
                        conn.fail(redis_exc.ConnectionError(str(reply)))
                        raise redis_exc.ConnectionError(f"redis refused the connection: {reply}")
        except BaseException as exc:
            if conn is not None and not conn.lost:  # e.g. timed out logging in: close what was opened
                conn.fail(redis_exc.ConnectionError("the connection attempt failed"))
            if isinstance(exc, OSError):
                raise redis_exc.ConnectionError(f"cannot connect to redis: {exc}") from exc
            raise
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a peer that vanishes without a FIN (a dead host, a dropped NAT entry) is found by the
            # kernel too, not only by the watchdog while commands wait
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._closed:
            conn.fail(redis_exc.ConnectionError("the store is shutting down"))
            raise redis_exc.ConnectionError("the store is shutting down")
        self._conn = conn
        self.connects += 1
        return conn

    def _ssl_context(self) -> ssl_module.SSLContext:
        kw = self._kwargs
        context = ssl_module.create_default_context(cafile=kw.get("ssl_ca_certs"))
        reqs = kw.get("ssl_cert_reqs", "required")
        if isinstance(reqs, str):
            reqs = {
                "none": ssl_module.CERT_NONE,
                "optional": ssl_module.CERT_OPTIONAL,
                "required": ssl_module.CERT_REQUIRED,
            }[reqs.lower()]
        context.check_hostname = bool(kw.get("ssl_check_hostname", reqs != ssl_module.CERT_NONE))
        context.verify_mode = reqs
        if kw.get("ssl_certfile"):
            context.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"), kw.get("ssl_password"))
        return context


class ScriptBatcher:
    """Runs one Lua script for many concurrent callers over a `Pipeline`."""

    def __init__(self, client: aioredis.Redis, source: str, timeout_s: float) -> None:
        self._source = source
        self._sha = hashlib.sha1(source.encode()).hexdigest()
        self._pipe = Pipeline(client, timeout_s)

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        reply = await self._pipe.call("EVALSHA", self._sha, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
            loaded = await self._pipe.call("SCRIPT", "LOAD", self._source)
            if isinstance(loaded, hiredis.ReplyError):
                raise redis_exc.ResponseError(str(loaded))
            reply = await self._pipe.call("EVALSHA", self._sha, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError):
            raise redis_exc.ResponseError(str(reply))
        return reply

    def stats(self) -> dict[str, int]:
        return self._pipe.stats()

    async def aclose(self) -> None:
        await self._pipe.aclose()
