"""The async Redis store of rollouts and their calls. Key layout: `rlgate.episodes.keys`.

Every write that touches several keys is one Lua script; every Redis failure surfaces as
`StoreUnavailable` (translated here, in one place), so callers never mistake a lost write for success.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis import exceptions as redis_exc
from redis.asyncio.cluster import RedisCluster
from redis.typing import EncodableT, FieldT

from rlgate.episodes import _lua
from rlgate.episodes._batch import ScriptBatcher
from rlgate.episodes.errors import (
    ModeMismatch,
    RecordTooLarge,
    RolloutExists,
    RolloutFull,
    RolloutMissing,
    RolloutNotFound,
    RolloutNotOpen,
    StoreUnavailable,
    TaskMismatch,
    TooManyAttempts,
)
from rlgate.episodes.keys import Keys, parent_of, validate_id
from rlgate.episodes.records import (
    SCHEMA_VERSION,
    CallRecord,
    IndexedCall,
    Mode,
    Policy,
    Rollout,
    RolloutEvent,
    RolloutListing,
    RolloutSummary,
    RolloutView,
)

LEARNER_STEPS_KEPT = 10_000  # learner steps kept on their stream (about; XADD MAXLEN ~)
EVENTS_MAX = 256  # events kept per rollout (each at most EVENT_MAX_BYTES of JSON)
EVENT_MAX_BYTES = 16 * 1024
RETENTION_S = 7 * 86400.0  # a finished rollout's keys and its stream entry are kept this long (0: forever)
INDEX_MAX = 1_000_000  # rollouts the listing index keeps (the newest; `EpisodeStore.index_max`)
LIST_MAX = 1000  # most index entries one `list_rollouts` call reads
_SUMMARY_FIELDS = (
    "rollout_id",
    "task_id",
    "status",
    "mode",
    "created_at",
    "closed_at",
    "reward",
    "error",
    "agent_name",
    "first_version",
    "last_version",
)


# A Redis Cluster is named by the URL of any of its nodes with one of these schemes (the rest as redis://)
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
WAIT_REPLICAS_MAX = 16


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def parse_url(url: str) -> tuple[str, bool, int]:
    """A store URL as redis-py's URL, whether it names a Redis Cluster, and its `wait_replicas`.

    `redis+cluster://host:port` (or `rediss+cluster://`) names a cluster by any of its nodes; the query
    parameter `wait_replicas=N` (on either kind) makes every recorded call wait until N replicas hold it
    (`_batch`). Raises `ValueError` for a bad value or a database other than 0 on a cluster."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    wait = 0
    for name, value in query:
        if name == "wait_replicas":
            if not (value.isascii() and value.isdigit()) or int(value) > WAIT_REPLICAS_MAX:
                raise ValueError(
                    f"wait_replicas in the redis URL must be 0 .. {WAIT_REPLICAS_MAX}, not {value!r}"
                )
            wait = int(value)
    cluster = parts.scheme in CLUSTER_SCHEMES
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has database 0 only: drop the /N from the redis+cluster:// URL")
    rest = parts.query
    if any(name == "wait_replicas" for name, _ in query):  # the rest as it was written otherwise
        rest = urlencode([(name, value) for name, value in query if name != "wait_replicas"])
    # urlunsplit drops an empty authority (unix:///p becomes unix:/p, which redis-py refuses): a URL with
    # nothing to rewrite is returned as written, and a unix one gets its // back
    if not cluster and rest == parts.query:
        return url, cluster, wait
    plain = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES.get(parts.scheme, parts.scheme), query=rest))
    if parts.scheme == "unix" and not parts.netloc:
        plain = "unix://" + plain.removeprefix("unix:")
    return plain, cluster, wait


def standalone_url(url: str) -> str:
    """redis-py's URL for a Redis that must not be a cluster (rq's queue: rq does not run on one); raises
    `ValueError` (one line for the user) for a `redis+cluster://` URL."""
    plain, cluster, _ = parse_url(url)
    if cluster:
        raise ValueError("RLGATE_QUEUE_REDIS_URL must name a standalone Redis: rq does not run on a cluster")
    return plain


def _recorded(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and reply[0] == 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _unavailable(exc: Exception) -> StoreUnavailable:
    """The `StoreUnavailable` for a Redis failure."""
    if isinstance(exc, (redis_exc.ConnectionError, redis_exc.TimeoutError, OSError)):
        return StoreUnavailable(f"redis unavailable: {exc}")
    if isinstance(exc, redis_exc.RedisClusterException):  # not a RedisError: no node answers, say
        return StoreUnavailable(f"redis cluster unavailable: {exc}")
    text = str(exc)
    # redis-py's own errors keep the reply's code apart (`status_code`); the batcher's replies are plain
    # ResponseErrors with the whole text
    code = getattr(exc, "status_code", None) or text.split(" ", 1)[0]
    if isinstance(exc, redis_exc.AskError) or code in ("MOVED", "ASK"):  # a cluster client follows these
        return StoreUnavailable(
            f"redis answered {text[:200]!r}: it is a Redis Cluster node, named by a redis:// URL; name "
            "the cluster with redis+cluster://HOST:PORT (RLGATE_REDIS_URL)"
        )
    if isinstance(exc, redis_exc.ClusterDownError) or code == "CLUSTERDOWN":
        return StoreUnavailable(f"the Redis Cluster is down or failing over ({text[:200]!r}); retry later")
    return StoreUnavailable(f"redis error: {exc}")


@asynccontextmanager
async def _guard(timeout_s: float) -> AsyncIterator[None]:
    """Bound a Redis operation in time and translate every Redis failure into `StoreUnavailable`.

    One `asyncio.timeout` per operation instead of redis-py's per-command socket timeout, which wraps
    every write in `asyncio.wait_for` (a task per command on Python 3.11).
    """
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError as exc:
        raise StoreUnavailable(f"redis did not answer within {timeout_s} s") from exc
    except (redis_exc.RedisError, redis_exc.RedisClusterException, OSError) as exc:
        # redis-py answers a cancellation in the middle of a command by dropping the connection and
        # raising ConnectionError: the cancellation must stay one, or a cancelled loop never stops.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError() from exc
        raise _unavailable(exc) from exc
    # redis-py 8 can also swallow a cancellation and answer normally (measured: 25 of 40 cancelled
    # pollers kept running): a task that was asked to stop stops here.
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


class EpisodeStore:
    """Rollouts and their calls in Redis. Safe to share between tasks and between processes."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys | None = None,
        timeout_s: float = 5.0,
        rollout_ttl_s: float = 3600.0,
        retention_s: float = RETENTION_S,
        wait_replicas: int = 0,
    ) -> None:
        self.redis = redis
        self.cluster = isinstance(redis, RedisCluster)  # a Redis Cluster (`redis+cluster://`)
        self.keys = keys or Keys()
        self.timeout_s = timeout_s
        self.rollout_ttl_s = rollout_ttl_s
        # a rollout no learner will read again (consumed, expired, failed) keeps its keys this long, and
        # closed-episode entries every consumer group acknowledged stay on the stream this long (0: forever)
        self.retention_s = retention_s
        self.index_max = INDEX_MAX  # the listing index is trimmed to this many (the newest) rollouts
        # the most bytes of records and events one rollout may hold, its attempts' included (0: no limit)
        self.rollout_max_bytes = 0
        # rq's reward-job queue, when it is not in this Redis (`use_queue_redis`); on a cluster it never is
        self.queue_redis: aioredis.Redis | None = None
        self._create = redis.register_script(_lua.CREATE_ROLLOUT)
        # recorded calls wait for this many replicas (`_batch`; `?wait_replicas=N` in the URL)
        self.wait_replicas = wait_replicas
        self._record = ScriptBatcher(redis, _lua.RECORD_CALLS, timeout_s, wait_replicas)
        # durable scripts (`durable_script`) by source: one set of connections each, however many users
        self._durable: dict[str, ScriptBatcher] = {}
        self._append_event = redis.register_script(_lua.APPEND_EVENT)

    def durable_script(self, source: str) -> Any:
        """A Lua script for writes a caller is told are done (a reward closing an episode, its stream entry):
        with `wait_replicas`, it runs over pipelined connections of its own (`_batch`) and answers only once
        that many replicas hold what it wrote (else `redis.exceptions.TimeoutError`), as a recorded call
        does; without, it is redis-py's registered script. Called as `script(keys=[...], args=[...])`, with
        `wrote=` (a reply -> bool) to wait only for replies that tell of a write. Callers bound it with
        `durable_guard`."""
        if not self.wait_replicas:
            registered = self.redis.register_script(source)

            async def script(keys: list[str], args: list[Any], wrote: Any = None) -> Any:
                return await registered(keys=keys, args=args)

            return script
        batcher = self._durable.get(source)
        if batcher is None:
            batcher = self._durable[source] = ScriptBatcher(
                self.redis, source, self.timeout_s, self.wait_replicas
            )
        return batcher

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "rlgate",
        timeout_s: float = 5.0,
        rollout_ttl_s: float = 3600.0,
        retention_s: float = RETENTION_S,
        max_connections: int = 64,
    ) -> EpisodeStore:
        """A store on its own connection pool. `timeout_s` bounds every operation, so a hung Redis
        turns into `StoreUnavailable` instead of a hung call; open rollouts expire `rollout_ttl_s` after
        they were created; finished ones are kept `retention_s` (`EpisodeStore.retention_s`). A
        `redis+cluster://` URL names a Redis Cluster by one of its nodes (`parse_url`)."""
        plain, cluster, wait_replicas = parse_url(url)
        client: Any
        if cluster:
            # no socket timeout, as on a single Redis (`_guard` bounds each operation): redis-py's cluster
            # client retries a command that timed out, which would run an XADD or a script twice
            client = RedisCluster.from_url(
                plain, socket_connect_timeout=timeout_s, socket_timeout=None, max_connections=max_connections
            )
        else:
            client = aioredis.Redis.from_url(
                plain,
                socket_connect_timeout=timeout_s,
                max_connections=max_connections,
                health_check_interval=30,
            )
        return cls(client, Keys(prefix), timeout_s, rollout_ttl_s, retention_s, wait_replicas)

    def guard(self, extra_s: float = 0.0) -> Any:
        """`async with store.guard():` bounds a Redis operation (by the store's timeout plus `extra_s`, for
        blocking reads) and translates its failures into `StoreUnavailable`."""
        return _guard(self.timeout_s + extra_s)

    def durable_guard(self, scripts: int = 1) -> Any:
        """`guard` for an operation that runs `scripts` durable scripts: with `wait_replicas` each may take
        two WAITs (half the timeout each) and a script load besides, so each adds twice the timeout to the
        bound; without, the bound is `guard`'s."""
        return self.guard(2 * scripts * self.timeout_s if self.wait_replicas else 0.0)

    def record_stats(self) -> dict[str, int]:
        """The record connection's counters (`_batch.Pipeline.stats`), for the gateway's metrics."""
        return self._record.stats()

    def use_queue_redis(self, url: str | None) -> None:
        """Read the reward-job queue's length (`backlog`, the dashboard) from the Redis at `url` (rq's
        `RLGATE_QUEUE_REDIS_URL`) instead of this one; None: this one (none on a cluster)."""
        if url:
            self.queue_redis = aioredis.Redis.from_url(
                standalone_url(url), socket_connect_timeout=self.timeout_s, max_connections=4
            )

    async def queue_length(self, queue_key: str) -> int:
        """Reward jobs waiting in the rq queue at `queue_key` (0 where no queue is reachable: a cluster
        without `use_queue_redis`)."""
        client = self.queue_redis if self.queue_redis is not None else None if self.cluster else self.redis
        if client is None:
            return 0
        async with _guard(self.timeout_s):
            return int(await client.llen(queue_key))

    async def aclose(self) -> None:
        await self._record.aclose()
        for batcher in self._durable.values():
            await batcher.aclose()
        await self.redis.aclose()
        if self.queue_redis is not None:
            await self.queue_redis.aclose()

    async def ping(self) -> None:
        async with _guard(self.timeout_s):
            await self.redis.ping()

    async def is_cluster_node(self) -> bool:
        """Whether a standalone client (a redis:// URL) was pointed at a node of a Redis Cluster: its
        calls would be answered MOVED for most keys. Always False on a cluster client."""
        if self.cluster:
            return False
        try:
            async with _guard(self.timeout_s):
                info = await self.redis.info("cluster")
        except StoreUnavailable as exc:
            if isinstance(exc.__cause__, redis_exc.ResponseError):  # INFO forbidden (an ACL) or renamed
                return False  # unknown: a cluster node would still be told by its MOVED replies
            raise
        return str(info.get("cluster_enabled", 0)) == "1"

    async def create_rollout(
        self,
        rollout_id: str,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        mode: Mode = "train",
    ) -> Rollout:
        """Create an open rollout; raise `RolloutExists` if the id is taken."""
        validate_id(rollout_id, "rollout id")
        if task_id is not None:
            validate_id(task_id, "task id")
        now = time.time()
        expires_at = now + self.rollout_ttl_s
        rollout = Rollout(
            rollout_id=rollout_id,
            task_id=task_id,
            created_at=now,
            metadata=metadata or {},
            expires_at=expires_at,
            mode=mode,
        )
        async with _guard(self.timeout_s):
            created = await self._create(
                keys=[self.keys.rollout(rollout_id)],
                args=[
                    rollout_id,
                    task_id or "",
                    repr(now),
                    SCHEMA_VERSION,
                    orjson.dumps(rollout.metadata),
                    repr(rollout.expires_at),
                    mode,
                ],
            )
            if created:
                await self._schedule(rollout_id, now, expires_at)
        if not created:
            raise RolloutExists(f"rollout {rollout_id!r} already exists")
        return rollout

    async def record_calls(
        self,
        rollout_id: str,
        task_id: str | None,
        records: Sequence[CallRecord],
        *,
        must_exist: bool = False,
        max_bytes: int | None = None,
        max_calls: int = 0,
        mode: Mode | None = None,
        max_attempts: int = 16,
    ) -> int:
        """Append `records` to the rollout atomically, creating it if new. Returns the first index.

        Concurrent calls are group-committed: one pipelined round trip per batch (`_batch`).

        Raises `RolloutNotOpen` or `TaskMismatch` without writing anything; `RolloutMissing` when
        `must_exist` and the rollout is not there; `RecordTooLarge` when the records' JSON is over
        `max_bytes`; `RolloutFull` when the rollout would hold more than `max_calls` records (0: no limit);
        `ModeMismatch` when `mode` is given and the rollout is of the other one (a rollout created here gets
        `mode`, default train).

        An attempt (`{rollout_id}~{attempt_id}`, `keys.attempt_episode`) is created only while its rollout
        exists (`RolloutMissing` otherwise) and is open or failed (`RolloutNotOpen` naming the rollout),
        with at most `max_attempts` per rollout (`TooManyAttempts`); it takes the rollout's task and mode.
        """
        if not records:
            raise ValueError("record_calls needs at least one record")
        now = time.time()
        expires_at = now + self.rollout_ttl_s
        encoded = [record.model_dump_json().encode() for record in records]
        size = sum(map(len, encoded))
        if max_bytes is not None and size > max_bytes:
            raise RecordTooLarge(size, max_bytes)
        args: list[Any] = [
            rollout_id,
            task_id or "",
            repr(now),
            SCHEMA_VERSION,
            repr(expires_at),
            "1" if must_exist else "0",
            str(max_calls),
            mode or "",
            str(max_attempts),
            records[0].agent_name or "",  # one request's choices: one agent, one version
            records[0].policy_version,
            size,
            self.rollout_max_bytes,
            *encoded,
        ]
        keys = [self.keys.rollout(rollout_id), self.keys.calls(rollout_id)]
        parent = parent_of(rollout_id)
        if parent is not None:
            keys.append(self.keys.rollout(parent))
        # Bounded in time by the record connection's own watchdog (`_batch`), not by a timer per call.
        try:
            # with wait_replicas, only a call that was recorded (code 0) waits for the replicas
            code, *rest = await self._record(keys, args, wrote=_recorded)
        except (redis_exc.RedisError, redis_exc.RedisClusterException, OSError) as exc:
            raise _unavailable(exc) from exc
        if code == 3:
            raise RolloutMissing(parent or rollout_id)
        value, *created = rest
        if code == 4:
            raise RolloutFull(rollout_id, int(value), max_calls)
        if code == 5:
            raise ModeMismatch(parent or rollout_id, _text(value), mode or "")
        if code == 6:
            raise RolloutNotOpen(parent or rollout_id, _text(value))
        if code == 7:
            raise TooManyAttempts(parent or rollout_id, int(value))
        if code == 8:
            raise RolloutFull(parent or rollout_id, int(value), self.rollout_max_bytes, what="bytes")
        if code == 0 and created[0]:  # a rollout born with its first call: schedule its expiry
            try:
                async with _guard(self.timeout_s):
                    await self._schedule(rollout_id, now, expires_at)
            except StoreUnavailable:
                # The call is recorded; failing it now would leave a record the agent never got. The
                # rollout then just does not expire by itself (a reward still closes it), nor is it listed.
                pass
        if code == 0:
            return int(value)
        value = value.decode() if isinstance(value, bytes) else str(value)
        if code == 1:
            raise RolloutNotOpen(rollout_id, value)
        raise TaskMismatch(rollout_id, value, task_id or "")

    async def _schedule(self, rollout_id: str, created_at: float, expires_at: float) -> None:
        """A new rollout's global entries, in one round trip: its expiry, and its place in the listing index
        (trimmed to the newest `index_max`). Not in the creating script: these keys live in other slots."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.expiry, {rollout_id: expires_at})
        pipe.zadd(self.keys.rollouts, {rollout_id: created_at})
        pipe.zremrangebyrank(self.keys.rollouts, 0, -self.index_max - 1)
        await pipe.execute()

    async def list_rollouts(
        self,
        *,
        task_id: str | None = None,
        status: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> RolloutListing:
        """One page of rollouts, newest first, from the listing index (`Keys.rollouts`).

        Reads at most `limit` (1 .. `LIST_MAX`) index entries created in [since, until], or, with `cursor`
        (the previous page's `next_cursor`), the entries after that page. The candidates' hashes are read
        with one HMGET each, pipelined; `task_id` and `status` then filter them, so a filtered page may hold
        fewer than `limit` rollouts, even none, with a `next_cursor` to continue: the listing is over when
        `next_cursor` is null. Rollouts whose hash is gone are left out. Raises `ValueError` for a cursor
        that is not one.
        """
        if not 1 <= limit <= LIST_MAX:
            raise ValueError(f"limit must be 1 .. {LIST_MAX}")
        top: float | str = "+inf" if until is None else until
        skip = 0
        if cursor is not None:
            top, skip = _parse_cursor(cursor)
        bottom: float | str = "-inf" if since is None else since
        async with _guard(self.timeout_s):
            entries = cast(
                list[tuple[bytes, float]],
                await self.redis.zrange(
                    self.keys.rollouts,
                    top,
                    bottom,
                    desc=True,
                    byscore=True,
                    offset=skip,
                    num=limit,
                    withscores=True,
                ),
            )
            pipe = self.redis.pipeline(transaction=False)
            for member, _ in entries:
                rid = _text(member)
                pipe.hmget(self.keys.rollout(rid), *_SUMMARY_FIELDS)
                pipe.llen(self.keys.calls(rid))
            replies = await pipe.execute() if entries else []
        next_cursor = None
        if len(entries) == limit:  # a full page: there may be more
            last = entries[-1][1]
            ties = sum(1 for _, score in entries if score == last)
            if cursor is not None and ties == len(entries) and float(top) == last:
                ties += skip  # the whole page sits on the cursor's timestamp: skip past it too
            next_cursor = f"{last!r}:{ties}"

        def decode() -> list[RolloutSummary]:
            rows = []
            for i in range(0, len(replies), 2):
                values, calls = replies[i], replies[i + 1]
                if values[2] is None:  # no status: the hash is gone
                    continue
                data: dict[str, str | None] = {
                    name: _text(value)
                    for name, value in zip(_SUMMARY_FIELDS, values, strict=True)
                    if value is not None
                }
                data["task_id"] = data.get("task_id") or None
                if (task_id is None or data["task_id"] == task_id) and (
                    status is None or data["status"] == status
                ):
                    rows.append(RolloutSummary.model_validate({**data, "calls": calls}))
            return rows

        rollouts = await asyncio.to_thread(decode) if len(entries) > 100 else decode()
        return RolloutListing(rollouts=rollouts, next_cursor=next_cursor)

    async def get_rollout(self, rollout_id: str) -> Rollout | None:
        async with _guard(self.timeout_s):
            fields = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.rollout(rollout_id)))
        if not fields:
            return None
        return _rollout_from_hash(fields)

    async def get_calls(self, rollout_id: str, start: int = 0, stop: int = -1) -> list[CallRecord]:
        if start < 0:  # shared requests are found by absolute index
            start = max(0, await self._llen(rollout_id) + start)
        async with _guard(self.timeout_s):
            raw = await self.redis.lrange(self.keys.calls(rollout_id), start, stop)
        items = await self._with_requests(rollout_id, [orjson.loads(item) for item in raw], start)
        return [CallRecord.model_validate(item) for item in items]

    async def _llen(self, rollout_id: str) -> int:
        async with _guard(self.timeout_s):
            return int(await self.redis.llen(self.keys.calls(rollout_id)))

    async def _with_requests(
        self, rollout_id: str, items: list[dict[str, Any]], offset: int
    ) -> list[dict[str, Any]]:
        """Fill in the request of choices stored with `request_shared` (n > 1) from their call's choice 0:
        from the same page, or read (one LINDEX each) when the page starts after it."""
        missing: dict[int, dict[str, Any] | None] = {}
        for i, item in enumerate(items, offset):
            if item.get("request_shared"):
                source = i - int(item.get("choice_index") or 0)
                if source < offset:
                    missing[source] = None
        if missing:
            async with _guard(self.timeout_s):
                pipe = self.redis.pipeline(transaction=False)
                for source in missing:
                    pipe.lindex(self.keys.calls(rollout_id), source)
                found = await pipe.execute()
            for source, raw in zip(missing, found, strict=True):
                missing[source] = orjson.loads(raw).get("request") if raw else None
        for i, item in enumerate(items, offset):
            if item.get("request_shared"):
                source = i - int(item.get("choice_index") or 0)
                request = items[source - offset].get("request") if source >= offset else missing.get(source)
                item["request"] = request if isinstance(request, dict) else {}
        return items

    async def get_rollout_view(
        self, rollout_id: str, offset: int = 0, limit: int | None = None
    ) -> RolloutView | None:
        """The rollout, its calls and their intermediate rewards, read in one round trip (a MULTI).

        `offset`/`limit`: only calls offset .. offset+limit-1 (all from `offset` without a limit). Calls
        of more than 1 MiB in all are decoded in a worker thread, off the event loop."""
        last = -1 if limit is None else offset + limit - 1
        async with _guard(self.timeout_s):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self.keys.rollout(rollout_id))
                pipe.lrange(self.keys.calls(rollout_id), offset, last)
                pipe.hgetall(self.keys.rewards(rollout_id))
                pipe.hgetall(self.keys.air(rollout_id))
                pipe.lrange(self.keys.events(rollout_id), 0, EVENTS_MAX - 1)
                fields, raw_calls, rewards, air, raw_events = await pipe.execute()
        if not fields:
            return None
        rollout = _rollout_from_hash(fields)
        rewards = {int(k): float(v) for k, v in rewards.items()}
        air = {int(k): float(v) for k, v in air.items()}

        big = sum(len(item) for item in raw_calls) > 1 << 20
        items = (
            await asyncio.to_thread(lambda: [orjson.loads(item) for item in raw_calls])
            if big
            else [orjson.loads(item) for item in raw_calls]
        )
        items = await self._with_requests(rollout_id, items, offset)

        def decode() -> list[IndexedCall]:
            return [
                IndexedCall.model_validate(
                    {**item, "index": i, "reward": rewards.get(i), "air_reward": air.get(i)}
                )
                for i, item in enumerate(items, offset)
            ]

        calls = await asyncio.to_thread(decode) if big else decode()
        events = [RolloutEvent.model_validate_json(item) for item in raw_events]
        return RolloutView(**rollout.model_dump(), calls=calls, events=events)

    async def append_event(self, rollout_id: str, event: RolloutEvent) -> int:
        """Keep an event the agent posted with its open rollout; returns its index. Raises
        `RolloutNotFound`, `RolloutNotOpen`, or `RolloutFull` when it holds `EVENTS_MAX` already."""
        async with _guard(self.timeout_s):
            keys = [self.keys.rollout(rollout_id), self.keys.events(rollout_id)]
            parent = parent_of(rollout_id)
            if parent is not None:
                keys.append(self.keys.rollout(parent))
            reply = await self._append_event(
                keys=keys, args=[event.model_dump_json(), EVENTS_MAX, self.rollout_max_bytes]
            )
        if reply[0] == 0:
            return int(reply[1])
        if reply[0] == 2:
            raise RolloutFull(rollout_id, EVENTS_MAX, EVENTS_MAX, what="events")
        if reply[0] == 3:
            raise RolloutFull(parent or rollout_id, int(reply[1]), self.rollout_max_bytes, what="bytes")
        status = _text(reply[1])
        if not status:
            raise RolloutNotFound(f"no rollout {rollout_id!r}")
        raise RolloutNotOpen(rollout_id, status)

    async def add_learner_step(self, metrics: dict[str, Any], keep: int = LEARNER_STEPS_KEPT) -> None:
        """Keep one learner step's numbers (JSON) on the capped `learner:steps` stream."""
        async with _guard(self.timeout_s):
            await self.redis.xadd(
                self.keys.learner_steps, {"data": orjson.dumps(metrics)}, maxlen=keep, approximate=True
            )

    async def learner_steps(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest `count` learner steps, oldest first."""
        async with _guard(self.timeout_s):
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await self.redis.xrevrange(self.keys.learner_steps, count=count),
            )
        return [orjson.loads(fields[b"data"]) for _, fields in reversed(entries)]

    async def policy(self) -> Policy:
        """The current policy pointer (version 0 and no adapter before the learner's first push)."""
        return await self.stored_policy() or Policy()

    async def stored_policy(self) -> Policy | None:
        """The policy pointer, or None when none is stored (no push yet, or Redis lost it)."""
        async with _guard(self.timeout_s):
            fields = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.policy))
        if not fields:
            return None
        return Policy.model_validate({k.decode(): v.decode() for k, v in fields.items() if v != b""})

    async def backlog(self, reward_queue_key: str | None = None, group: str = "learners") -> int:
        """Episodes waiting between the agents and the learners: closed but not yet acknowledged by the
        learners' consumer group `group` (its lag, i.e. entries not yet delivered, plus its pending
        entries; nothing while that group does not exist: a deployment that only records, or a learner
        not started yet), plus the reward jobs waiting in the rq queue at `reward_queue_key` (episodes
        asked to be graded and not yet closed). Other consumer groups (an old experiment's) do not count."""
        waiting = await self.queue_length(reward_queue_key) if reward_queue_key else 0
        async with _guard(self.timeout_s):
            exists = await self.redis.exists(self.keys.episodes)
            groups = await self.redis.xinfo_groups(self.keys.episodes) if exists else []
        for info in groups:
            name = info.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == group:
                # lag is None before Redis 7 and on a stream trimmed under the group: then only the
                # pending entries count (an undercount never holds agents back for nothing)
                waiting += int(info.get("lag") or 0) + int(info.get("pending") or 0)
        return waiting

    async def epoch(self, create: bool = False) -> str | None:
        """The store's epoch marker (`keys.epoch`); with `create`, written first if missing (SET NX, so
        every process that creates it agrees on one value)."""
        async with _guard(self.timeout_s):
            value = cast(bytes | None, await self.redis.get(self.keys.epoch))
            if value is None and create:
                await self.redis.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
                value = cast(bytes | None, await self.redis.get(self.keys.epoch))
        return value.decode() if value is not None else None

    async def check_writable(self) -> None:
        """A small write with a TTL: raises `StoreUnavailable` when Redis refuses writes (maxmemory with
        noeviction, a read-only replica, a full disk under `stop-writes-on-bgsave-error`)."""
        async with _guard(self.timeout_s):
            await self.redis.set(self.keys.health, repr(time.time()), px=60_000)

    async def memory(self) -> tuple[int, int]:
        """Redis's (used_memory, maxmemory) in bytes, maxmemory 0 where none is set; on a cluster, the
        primary closest to its maxmemory."""
        async with _guard(self.timeout_s):
            if self.cluster:
                replies = await self.redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
                infos = (
                    list(replies.values())
                    if isinstance(replies, dict) and "used_memory" not in replies
                    else [replies]
                )
            else:
                infos = [await self.redis.info("memory")]
        pairs = [(int(i.get("used_memory", 0)), int(i.get("maxmemory", 0))) for i in infos]
        return max(pairs, key=lambda p: p[0] / p[1] if p[1] else 0.0, default=(0, 0))

    async def rollout_exists(self, rollout_id: str) -> bool:
        async with _guard(self.timeout_s):
            return bool(await self.redis.exists(self.keys.rollout(rollout_id)))

    async def policy_version(self) -> int:
        """The current policy version (set by the learner after each weight push; 0 before any)."""
        return (await self.policy()).version

    async def set_server_version(self, server: str, version: int) -> None:
        """Record that inference server `server` (`keys.server_name`) loaded policy `version`: gateways
        route to it only once it has the version the pointer names (`gateway.servers`)."""
        async with _guard(self.timeout_s):
            await self.redis.hset(self.keys.server_versions, server, version)

    async def set_policy(self, policy: Policy) -> None:
        """Move the policy pointer, all fields at once (one HSET), so a reader never sees a version
        with another version's adapter."""
        mapping: dict[FieldT, EncodableT] = {
            "version": policy.version,
            "adapter": policy.adapter or "",
            "base_model": policy.base_model or "",
            "draining": int(policy.draining),
        }
        async with _guard(self.timeout_s):
            await self.redis.hset(self.keys.policy, mapping=mapping)

    async def set_policy_version(self, version: int) -> None:
        await self.set_policy(Policy(version=version))


_JSON_FIELDS = ("metadata", "reward_metadata", "finish")
_INTERNAL_FIELDS = ("published", "claimed_by", "claimed_until_ms", "attempts", "bytes")


def _parse_cursor(cursor: str) -> tuple[float, int]:
    """A listing cursor: the creation time of the previous page's last rollout and how many rollouts of
    that time it held."""
    score, _, skip = cursor.rpartition(":")
    try:
        top, count = float(score), int(skip)
    except ValueError:
        raise ValueError(
            f"invalid cursor {cursor!r}: pass a next_cursor of GET /rollouts unchanged"
        ) from None
    if count < 0 or top != top:
        raise ValueError(f"invalid cursor {cursor!r}: pass a next_cursor of GET /rollouts unchanged")
    return top, count


def _rollout_from_hash(fields: dict[bytes, bytes]) -> Rollout:
    """A `Rollout` from its hash: JSON fields parsed, '' task id as None, bookkeeping fields dropped."""
    data: dict[str, Any] = {k.decode(): v.decode() for k, v in fields.items()}
    for name in _JSON_FIELDS:
        if name in data:
            data[name] = orjson.loads(data[name])
    for name in _INTERNAL_FIELDS:
        data.pop(name, None)
    data["task_id"] = data.get("task_id") or None
    return Rollout.model_validate(data)
