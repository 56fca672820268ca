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
The connection parameters (host and port or unix path, database, user and password or a credential
provider, client name, TLS) are read from the redis-py client the store was built with, so every URL the
store accepts works here too. Each of redis-py's connection options is honoured here, or does not apply
(what it does is done here another way: timeouts, retries, decoding), or is refused when set (`check_options`:
an error at start, never a connection that silently lacks what was asked for).

On a Redis Cluster (`redis.asyncio.RedisCluster`) there is one such connection per master: a script goes
to the master that owns the hash slot of its first key (every key of a script shares one slot), taken
from redis-py's slot map. A `MOVED` reply (a failover or a resharding moved the slot) refreshes that map
and sends the script to the node it names, an `ASK` reply (a slot being migrated) sends `ASKING` and the
script to the node it names; `CLUSTERDOWN`/`TRYAGAIN` replies and a master that cannot be connected to
are retried until `timeout_s` has passed (the script did not run), with the slot map refreshed. A
connection that breaks with commands in flight fails them (they may or may not have run) and refreshes
the map, so the next call finds the replica that took over.

With `wait_replicas` > 0 a `WAIT wait_replicas ms` (ms: half of `timeout_s`) follows the writes on their
connection: a caller returns only once that many replicas hold its write, so a replica that takes over
(Redis Cluster or Sentinel failover) has every call a caller was told was recorded. One WAIT is in flight
at a time (Redis runs nothing else of the connection while it blocks); the next covers every write sent
meanwhile, so a batch waits for at most two WAITs however many batches queue behind a slow replica. When
fewer replicas confirm in time the caller gets `redis.exceptions.TimeoutError` (the write is on the
master, not known to be replicated). A script that wrote nothing (an error reply, or a refusal the caller
recognises) does not wait.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import socket
import ssl as ssl_module
from collections.abc import Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis import exceptions as redis_exc
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot


class NotConnected(redis_exc.ConnectionError):
    """No connection could be opened: the command was not sent (safe to send again elsewhere)."""


# redis-py's connection options (the parameters of its Connection, SSLConnection and
# UnixDomainSocketConnection; tests/test_store.py checks these cover the installed redis-py's):
HONOURED = frozenset(
    {
        *("host", "port", "path", "db", "username", "password", "credential_provider", "client_name"),
        *(
            "ssl_ca_certs",
            "ssl_ca_path",
            "ssl_ca_data",
            "ssl_cert_reqs",
            "ssl_check_hostname",
            "ssl_certfile",
        ),
        *("ssl_keyfile", "ssl_password", "ssl_min_version", "ssl_ciphers", "ssl_include_verify_flags"),
        *("ssl_exclude_verify_flags", "connection_class"),
    }
)
NOT_APPLICABLE = frozenset(
    {
        # timeouts and liveness: the store's `timeout_s`, the watchdog, TCP keepalive (always on)
        *("socket_timeout", "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options"),
        *("health_check_interval", "orig_socket_timeout", "orig_socket_connect_timeout", "timeout"),
        # retries: a command sent is never sent again here (the module docstring's failure rules)
        *("retry", "retry_on_timeout", "retry_on_error"),
        # replies: parsed by hiredis and read by the store as bytes; RESP2 always (no HELLO: the scripts'
        # replies are the same in RESP3)
        *("encoding", "encoding_errors", "decode_responses", "encoder_class", "parser_class"),
        *("socket_read_size", "protocol", "legacy_responses", "response_callbacks", "parser"),
        # the client library's own bookkeeping: its name and version for CLIENT SETINFO, events, the pool,
        # and Redis Enterprise's maintenance notifications (a connection closed by the server reconnects)
        *(
            "lib_name",
            "lib_version",
            "driver_info",
            "event_dispatcher",
            "himport_registry",
            "max_connections",
        ),
        *("maint_notifications_config", "maint_notifications_pool_handler", "maintenance_state"),
        *("maintenance_notification_hash", "orig_host_address", "oss_cluster_maint_notifications_handler"),
    }
)
REFUSED = frozenset({"redis_connect_func", "socket_type"})  # a custom connect hook, another socket family


def _cluster_on_connect(value: Any) -> bool:
    """redis-py's own connect hook of a cluster client (READONLY, for reads from replicas): the record
    connection writes to masters only, so it does without."""
    return getattr(value, "__func__", None) is RedisCluster.on_connect


_CONNECTION_CLASSES = (aioredis.Connection, aioredis.SSLConnection, aioredis.UnixDomainSocketConnection)


def check_options(kwargs: dict[str, Any], connection_class: type | None = None) -> None:
    """Raise ValueError for a redis-py connection option that is set and that this connection does not
    honour (REFUSED, or one redis-py added after these lists were written), a connection class of the
    client's own (it would do something this connection does not), or a password beside a credential
    provider (redis-py refuses the pair too)."""
    if "connection_pool" in kwargs:  # a Sentinel-managed pool: its master is found at connect time
        raise ValueError(
            "the store's pipelined record connection (rlgate/episodes/_batch.py) does not support Redis Sentinel "
            "pools: give the store the master's URL"
        )
    if kwargs.get("credential_provider") is not None and (kwargs.get("username") or kwargs.get("password")):
        raise ValueError(
            "the Redis client has both a credential provider and a username or password: keep one"
        )
    cls = connection_class or kwargs.get("connection_class")
    unsupported = sorted(
        key
        for key, value in kwargs.items()
        if key not in HONOURED | NOT_APPLICABLE
        and value not in (None, 0)
        and not (key == "redis_connect_func" and _cluster_on_connect(value))
    )
    if cls is not None and cls not in _CONNECTION_CLASSES:
        unsupported.append(f"connection_class={cls.__name__}")
    if unsupported:
        raise ValueError(
            f"the store's pipelined record connection (rlgate/episodes/_batch.py) does not support the redis "
            f"option{'s' if len(unsupported) > 1 else ''} {', '.join(unsupported)}: leave "
            f"{'them' if len(unsupported) > 1 else 'it'} out of the Redis URL or client"
        )


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # a reply nobody waits for any more is not "never retrieved"


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
    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout_s: float, counts: Pipeline, wait: bytes | None = None
    ) -> None:
        self.loop = loop
        self.wait = wait  # the packed WAIT that follows durable calls (None: no WAIT)
        # At most one WAIT is in flight (Redis runs nothing else of this connection while it blocks): the
        # reply of the one sent, and the reply of the next one, which covers every durable command written
        # or buffered since and goes out when the first returns (or with the next flush).
        self.wait_sent: asyncio.Future[Any] | None = None
        self.wait_next: asyncio.Future[Any] | None = None
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
            if future is self.wait_sent:
                self.wait_sent = None
                if self.wait_next is not None and not self.flush_scheduled and self.transport is not None:
                    self.transport.write(self._send_wait())  # everything it covers is out already
                    self.counts.writes += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail_pending(
            redis_exc.ConnectionError("the connection to redis was closed" + (f": {exc}" if exc else ""))
        )

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        return self._call(packed, False)[0]

    def call_durable(self, packed: bytes) -> tuple[asyncio.Future[Any], asyncio.Future[Any] | None]:
        """The command's reply, and the reply of the first WAIT sent after it (None without WAIT)."""
        return self._call(packed, self.wait is not None)

    def _send_wait(self) -> bytes:
        """Put the next WAIT in flight: its reply comes after every command written before it."""
        assert self.wait is not None and self.wait_next is not None
        self.pending.append(self.wait_next)
        self.wait_sent, self.wait_next = self.wait_next, None
        self.counts.commands += 1
        return self.wait

    def _call(self, packed: bytes, durable: bool) -> tuple[asyncio.Future[Any], asyncio.Future[Any] | None]:
        future = self.loop.create_future()
        if self.lost:
            future.set_exception(redis_exc.ConnectionError("the connection to redis was closed"))
            return future, None
        idle = not self.pending
        self.pending.append(future)
        self.counts.commands += 1
        waited: asyncio.Future[Any] | None = None
        if durable:
            if self.wait_next is None:
                self.wait_next = self.loop.create_future()
            waited = self.wait_next
        if idle and not self.flush_scheduled and self.transport is not None:
            # nothing in flight: no batch to wait for, out at once (with its WAIT: none is in flight)
            self.transport.write(packed + self._send_wait() if durable else packed)
            self.counts.writes += 1
        else:
            self.out.append(packed)
            if not self.flush_scheduled:
                self.flush_scheduled = True
                self.loop.call_soon(self._flush)
        if self.watchdog is None:
            self.watchdog = self.loop.call_later(self.timeout_s, self._check, self.replies)
        return future, waited

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
        if self.wait_next is not None and self.wait_sent is None:
            self.out.append(self._send_wait())  # after the batch's commands: its reply after theirs
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
        if self.wait_next is not None:  # not sent: not in `pending`
            self.pending.append(self.wait_next)
        self.wait_next = self.wait_sent = None
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(exc)


class Pipeline:
    """One lazily opened, pipelined connection to one Redis server (`connection_kwargs` as redis-py's)."""

    def __init__(
        self, connection_kwargs: dict[str, Any], ssl: bool, timeout_s: float, wait_replicas: int = 0
    ) -> None:
        self._kwargs = dict(connection_kwargs)  # checked by whoever built it (`of`, `_Nodes`: check_options)
        self._ssl = ssl
        self._timeout_s = timeout_s
        self._wait_replicas = wait_replicas
        # WAIT's own time limit stays under the watchdog's, which would otherwise close the connection first
        self._wait = pack(("WAIT", wait_replicas, max(1, int(timeout_s * 500)))) if wait_replicas else None
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._closed = False
        self.connects = 0  # connections opened so far (more than one: Redis dropped one)
        self.commands = 0  # commands sent, and the writes that carried them (for the batch size)
        self.writes = 0

    @property
    def host(self) -> str:
        return str(self._kwargs.get("host", "localhost"))

    @property
    def name(self) -> str:
        """`host:port`, as redis-py names cluster nodes."""
        return f"{self.host}:{self._kwargs.get('port', 6379)}"

    @classmethod
    def of(cls, client: aioredis.Redis, timeout_s: float, wait_replicas: int = 0) -> Pipeline:
        """A pipeline to the Redis a (non-cluster) redis-py client talks to."""
        pool = client.connection_pool
        check_options(pool.connection_kwargs, pool.connection_class)
        ssl = issubclass(pool.connection_class, aioredis.SSLConnection)
        return cls(pool.connection_kwargs, ssl, timeout_s, wait_replicas)

    async def call(self, *args: Any) -> Any:
        """The reply to one command; a Redis error reply is returned as a `hiredis.ReplyError`."""
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connection()
        return await conn.call(pack(args))

    async def call_durable(
        self, *args: Any, asking: bool = False, wrote: Callable[[Any], bool] | None = None
    ) -> Any:
        """`call` (after `ASKING`, on the same connection, with `asking`), and with WAIT configured, only
        once the pipeline's `wait_replicas` replicas hold the write: else `redis.exceptions.TimeoutError`.
        An error reply, or a reply for which `wrote` says nothing was written, does not wait."""
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connection()
        if asking:
            conn.call(pack(("ASKING",))).add_done_callback(_retrieve)
        future, waited = conn.call_durable(pack(args))
        if waited is not None:
            waited.add_done_callback(_retrieve)  # nobody may await it (an error reply, a cancelled caller)
        reply = await future
        if (
            waited is None
            or isinstance(reply, hiredis.ReplyError)
            or (wrote is not None and not wrote(reply))
        ):
            return reply
        # shielded: the WAIT is shared by every command before it; one caller's cancellation is its own
        acked = await asyncio.shield(waited)
        if isinstance(acked, hiredis.ReplyError):  # the node became a replica, say: the write's fate unknown
            raise redis_exc.ConnectionError(f"redis refused WAIT after a write: {acked}")
        if int(acked) < self._wait_replicas:
            raise redis_exc.TimeoutError(
                f"the write reached the redis master but {acked} of {self._wait_replicas} replicas "
                f"confirmed it "
                f"within {self._timeout_s / 2} s"
            )
        return reply

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
                        lambda: _Connection(loop, self._timeout_s, self, self._wait), kw["path"]
                    )
                else:
                    ssl = self._ssl_context() if self._ssl else None
                    _, conn = await loop.create_connection(
                        lambda: _Connection(loop, self._timeout_s, self, self._wait),
                        kw.get("host", "localhost"),
                        int(kw.get("port", 6379)),
                        ssl=ssl,
                    )
                hello = []
                user, password = kw.get("username"), kw.get("password")
                provider = kw.get("credential_provider")
                if provider is not None:  # as redis-py: the provider's credentials replace user and password
                    get = getattr(provider, "get_credentials_async", None)
                    credentials = tuple(await get() if get else provider.get_credentials())
                    if len(credentials) not in (1, 2):
                        raise redis_exc.ConnectionError(
                            "the credential provider gave neither (password,) nor (user, password)"
                        )
                    user, password = credentials if len(credentials) == 2 else (None, credentials[0])
                if password:  # as redis-py: no AUTH for an empty password
                    hello.append(("AUTH", user, password) if user else ("AUTH", password))
                if kw.get("client_name"):
                    hello.append(("CLIENT", "SETNAME", kw["client_name"]))
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
                raise NotConnected(f"cannot connect to redis: {exc}") from exc
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
        context = ssl_module.create_default_context()  # the system's CAs, then the client's own (redis-py)
        if kw.get("ssl_ca_certs") or kw.get("ssl_ca_path") or kw.get("ssl_ca_data"):
            context.load_verify_locations(
                kw.get("ssl_ca_certs"), kw.get("ssl_ca_path"), kw.get("ssl_ca_data")
            )
        reqs = kw.get("ssl_cert_reqs", "required")
        if isinstance(reqs, str):
            reqs = {
                "none": ssl_module.CERT_NONE,
                "optional": ssl_module.CERT_OPTIONAL,
                "required": ssl_module.CERT_REQUIRED,
            }[reqs.lower()]
        # no hostname check without certificate verification (as redis-py: ssl refuses the combination)
        context.check_hostname = bool(kw.get("ssl_check_hostname", True)) and reqs != ssl_module.CERT_NONE
        context.verify_mode = reqs
        if kw.get("ssl_certfile"):
            context.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"), kw.get("ssl_password"))
        if kw.get("ssl_min_version") is not None:
            context.minimum_version = ssl_module.TLSVersion(kw["ssl_min_version"])
        if kw.get("ssl_ciphers"):
            context.set_ciphers(kw["ssl_ciphers"])
        for flag in kw.get("ssl_include_verify_flags") or ():
            context.verify_flags |= flag
        for flag in kw.get("ssl_exclude_verify_flags") or ():
            context.verify_flags &= ~flag
        return context


_REDIRECTS = 5  # MOVED/ASK replies followed for one call before giving up
_RETRY_S = 0.1  # pause before sending again after CLUSTERDOWN, TRYAGAIN or a master that cannot be reached


class _Nodes:
    """The pipelined connections to a Redis Cluster's masters, one per node, routed by hash slot."""

    def __init__(self, client: RedisCluster, timeout_s: float, wait_replicas: int) -> None:
        check_options(client.nodes_manager.connection_kwargs)  # at start, not at a node's first call
        self.client = client
        self.timeout_s = timeout_s
        self.wait_replicas = wait_replicas
        self.pipes: dict[str, Pipeline] = {}
        self.refreshes = 0  # slot map refreshes asked for (after MOVED or a lost node)
        self._refreshing: asyncio.Future[None] | None = None

    def pipe(self, host: str, port: int) -> Pipeline:
        name = f"{host}:{port}"
        pipe = self.pipes.get(name)
        if pipe is None:
            nm = self.client.nodes_manager
            kwargs = {**nm.connection_kwargs, "host": host, "port": port}
            kwargs.pop("connection_class", None)
            ssl = issubclass(
                nm.connection_kwargs.get("connection_class", aioredis.Connection), aioredis.SSLConnection
            )
            pipe = self.pipes[name] = Pipeline(kwargs, ssl, self.timeout_s, self.wait_replicas)
        return pipe

    async def owner(self, slot: int) -> Pipeline:
        if self.client._initialize:
            await self.client.initialize()
        node = self.client.nodes_manager.get_node_from_slot(slot)
        return self.pipe(node.host, int(node.port))

    def refresh(self, failed: str | None = None) -> asyncio.Future[None]:
        """Reload the slot map from the cluster, once for all callers asking at the same time."""
        if self._refreshing is None or self._refreshing.done():
            self.refreshes += 1
            self._refreshing = asyncio.ensure_future(
                self.client.nodes_manager.initialize(last_failed_node_name=failed)
            )
            self._refreshing.add_done_callback(_retrieve)
        return self._refreshing

    async def aclose(self) -> None:
        for pipe in self.pipes.values():
            await pipe.aclose()
        if self._refreshing is not None:
            self._refreshing.cancel()


class ScriptBatcher:
    """Runs one Lua script for many concurrent callers over a `Pipeline`, or on a Redis Cluster over one
    `Pipeline` per master (module docstring). `wait_replicas`: WAIT for that many replicas after each batch."""

    def __init__(
        self, client: aioredis.Redis | RedisCluster, source: str, timeout_s: float, wait_replicas: int = 0
    ) -> None:
        self._source = source
        self._sha = hashlib.sha1(source.encode()).hexdigest()
        self._timeout_s = timeout_s
        if isinstance(client, RedisCluster):
            self._nodes: _Nodes | None = _Nodes(client, timeout_s, wait_replicas)
            self._pipe: Pipeline | None = None
        else:
            self._nodes = None
            self._pipe = Pipeline.of(client, timeout_s, wait_replicas)

    async def __call__(
        self, keys: list[str], args: list[Any], wrote: Callable[[Any], bool] | None = None
    ) -> Any:
        """The script's reply. With `wait_replicas`, a reply for which `wrote` is true (always, without
        `wrote`) comes back only once the replicas hold the write."""
        command = ("EVALSHA", self._sha, len(keys), *keys, *args)
        if self._nodes is None:
            assert self._pipe is not None
            reply = await self._run(self._pipe, command, wrote=wrote)
        else:
            reply = await self._routed(key_slot(keys[0].encode()), command, wrote)
        if isinstance(reply, hiredis.ReplyError):
            raise redis_exc.ResponseError(str(reply))
        return reply

    async def _run(
        self,
        pipe: Pipeline,
        command: tuple[Any, ...],
        asking: bool = False,
        wrote: Callable[[Any], bool] | None = None,
    ) -> Any:
        """The script's reply from one node, loading the script there first if it lacks it."""
        for _ in range(2):
            reply = await pipe.call_durable(*command, asking=asking, wrote=wrote)
            if not (isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT")):
                return reply
            loaded = await pipe.call("SCRIPT", "LOAD", self._source)
            if isinstance(loaded, hiredis.ReplyError):
                raise redis_exc.ResponseError(str(loaded))
        return reply

    async def _routed(self, slot: int, command: tuple[Any, ...], wrote: Callable[[Any], bool] | None) -> Any:
        nodes = self._nodes
        assert nodes is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        pipe = await nodes.owner(slot)
        asking = False
        redirects = 0
        while True:
            try:
                reply = await self._run(pipe, command, asking, wrote)
            except NotConnected:
                # the master is gone and the script never left: once a replica has taken over, the slot
                # map names it
                if loop.time() + _RETRY_S > deadline:
                    raise
                await asyncio.sleep(_RETRY_S)
                await _bounded(nodes.refresh(pipe.name), deadline - loop.time())
                pipe, asking = await nodes.owner(slot), False
                continue
            except (redis_exc.ConnectionError, redis_exc.TimeoutError):
                # sent, outcome unknown (a lost or a hung master: its replica may be taking over): the caller
                # hears so; the next call asks the refreshed map
                nodes.refresh(pipe.name)
                raise
            if not isinstance(reply, hiredis.ReplyError):
                return reply
            kind, _, rest = str(reply).partition(" ")
            if kind in ("MOVED", "ASK") and redirects < _REDIRECTS:
                redirects += 1
                host, _, port = rest.split(" ")[-1].rpartition(":")
                if kind == "MOVED":
                    nodes.refresh()
                # an empty host (cluster-preferred-endpoint-type unknown-endpoint): the node that answered
                pipe, asking = nodes.pipe(host or pipe.host, int(port)), kind == "ASK"
                continue
            if kind in ("CLUSTERDOWN", "TRYAGAIN") and loop.time() + _RETRY_S <= deadline:
                await asyncio.sleep(
                    _RETRY_S
                )  # a failover in progress, a migrating slot: the script did not run
                if kind == "CLUSTERDOWN":
                    await _bounded(nodes.refresh(), deadline - loop.time())
                    pipe, asking = await nodes.owner(slot), False
                continue
            return reply

    def stats(self) -> dict[str, int]:
        if self._pipe is not None:
            return self._pipe.stats()
        assert self._nodes is not None
        totals = {"connects": 0, "commands": 0, "writes": 0, "in_flight": 0}
        for pipe in self._nodes.pipes.values():
            for name, value in pipe.stats().items():
                totals[name] += value
        return totals

    async def aclose(self) -> None:
        if self._pipe is not None:
            await self._pipe.aclose()
        if self._nodes is not None:
            await self._nodes.aclose()


async def _bounded(task: asyncio.Future[None], seconds: float) -> None:
    """Wait for a slot map refresh at most `seconds`; its failure is the next attempt's problem."""
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await asyncio.shield(task)
    except (TimeoutError, redis_exc.RedisError, redis_exc.RedisClusterException, OSError):
        pass
