"""The episode store against the real Redis: key layout, atomic create/record, errors."""

from __future__ import annotations

import asyncio

import pytest
import redis
from conftest import REDIS_URL, call_record

from rlgate.episodes import (
    CallRecord,
    EpisodeStore,
    InvalidId,
    Keys,
    ModeMismatch,
    RolloutExists,
    RolloutNotOpen,
    StoreUnavailable,
    TaskMismatch,
)


def run(coro):
    return asyncio.run(coro)


def test_keys_share_a_cluster_hash_tag():
    keys = Keys("rlgate")
    assert keys.rollout("abc") == "rlgate:rollout:{abc}"
    assert keys.calls("abc") == "rlgate:rollout:{abc}:calls"
    # redis-py's own cluster slot function agrees that both keys live in one slot
    from redis.crc import key_slot

    assert key_slot(keys.rollout("r-1").encode()) == key_slot(keys.calls("r-1").encode())
    with pytest.raises(InvalidId):
        Keys("bad{prefix")


def test_record_creates_rollout_and_indexes_calls(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            first = await store.record_calls("r1", "task-a", [call_record("r1", task_id="task-a")])
            second = await store.record_calls(
                "r1", "task-a", [call_record("r1", choice_index=0), call_record("r1", choice_index=1)]
            )
            view = await store.get_rollout_view("r1")
            return first, second, view
        finally:
            await store.aclose()

    first, second, view = run(go())
    assert (first, second) == (0, 1)
    assert view.rollout_id == "r1" and view.task_id == "task-a" and view.status == "open"
    assert [c.index for c in view.calls] == [0, 1, 2]
    assert [c.choice_index for c in view.calls] == [0, 0, 1]
    assert view.calls[0].completion_token_ids == [4, 5]
    assert redis_client.type("t:rollout:{r1}") == b"hash"
    assert redis_client.llen("t:rollout:{r1}:calls") == 3


def test_the_rollout_hash_keeps_its_agent_and_served_versions(redis_client: redis.Redis):
    """What a listing shows of a rollout's calls comes from its hash, kept by the record script: the first
    named agent, the lowest and highest version that served it (in whatever order calls commit)."""

    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            await store.record_calls("r9", "t9", [call_record("r9", policy_version=4)])  # no agent named
            before = (await store.list_rollouts(limit=10)).rollouts
            await store.record_calls("r9", None, [call_record("r9", policy_version=2, agent_name="planner")])
            await store.record_calls("r9", None, [call_record("r9", policy_version=7, agent_name="coder")])
            await store.record_calls("r9", None, [call_record("r9", policy_version=3, agent_name="coder")])
            # refused calls change nothing
            with pytest.raises(ModeMismatch):
                await store.record_calls(
                    "r9", None, [call_record("r9", policy_version=0, agent_name="x")], mode="val"
                )
            with pytest.raises(TaskMismatch):
                await store.record_calls(
                    "r9", "other", [call_record("r9", policy_version=99, agent_name="x")]
                )
            return before, (await store.list_rollouts(limit=10)).rollouts, await store.get_rollout("r9")
        finally:
            await store.aclose()

    before, after, rollout = run(go())
    assert [(r.agent_name, r.first_version, r.last_version) for r in before] == [(None, 4, 4)]
    assert [(r.agent_name, r.first_version, r.last_version, r.calls) for r in after] == [("planner", 2, 7, 4)]
    assert (rollout.agent_name, rollout.first_version, rollout.last_version) == ("planner", 2, 7)
    assert redis_client.hmget("t:rollout:{r9}", "agent_name", "first_version", "last_version") == [
        b"planner",
        b"2",
        b"7",
    ]


def test_create_rollout_once_and_task_mismatch(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            created = await store.create_rollout("r2", "task-b", {"split": "train"})
            with pytest.raises(RolloutExists):
                await store.create_rollout("r2", None)
            with pytest.raises(TaskMismatch):
                await store.record_calls("r2", "other-task", [call_record("r2")])
            # a call without a task id joins the rollout's task
            await store.record_calls("r2", None, [call_record("r2")])
            return created, await store.get_rollout("r2"), await store.get_calls("r2")
        finally:
            await store.aclose()

    created, rollout, calls = run(go())
    assert created.metadata == {"split": "train"}
    assert rollout.task_id == "task-b" and rollout.metadata == {"split": "train"}
    assert len(calls) == 1  # the mismatched call wrote nothing


def test_calls_to_a_rollout_that_is_not_open_are_refused(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            await store.create_rollout("r3")
            redis_client.hset("t:rollout:{r3}", "status", "closed")
            with pytest.raises(RolloutNotOpen) as info:
                await store.record_calls("r3", None, [call_record("r3")])
            return info.value
        finally:
            await store.aclose()

    assert run(go()).status == "closed"
    assert redis_client.llen("t:rollout:{r3}:calls") == 0


def test_policy_version_defaults_to_zero(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            before = await store.policy_version()
            await store.set_policy_version(7)
            return before, await store.policy_version()
        finally:
            await store.aclose()

    assert run(go()) == (0, 7)


def test_unreachable_redis_raises_store_unavailable():
    async def go():
        store = EpisodeStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.5)
        try:
            await store.record_calls("r4", None, [call_record("r4")])
        finally:
            await store.aclose()

    with pytest.raises(StoreUnavailable):
        run(go())


def test_record_round_trips_through_json():
    record = call_record("r5", error=None, ttfb_ms=3.5)
    assert CallRecord.model_validate_json(record.model_dump_json()) == record
    assert record.trainable
    assert call_record("r5", completion_logprobs=None).trainable  # the learner takes its own log-probs then
    assert not call_record("r5", completion_logprobs=[-0.5]).trainable  # not one per token
    assert not call_record("r5", completion_token_ids=None).trainable
    with pytest.raises(ValueError):
        CallRecord.model_validate({**record.model_dump(), "unknown_field": 1})


def test_concurrent_records_are_group_committed_in_order(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            firsts = await asyncio.gather(
                *(
                    store.record_calls("r6", None, [call_record("r6", choice_index=i)] * (1 + i % 2))
                    for i in range(40)
                )
            )
            return firsts, await store.get_calls("r6")
        finally:
            await store.aclose()

    firsts, calls = run(go())
    sizes = [1 + i % 2 for i in range(40)]
    assert len(calls) == sum(sizes) == 60
    # every caller got the index its records landed at, and a caller's records are contiguous
    for i, first in enumerate(firsts):
        assert [c.choice_index for c in calls[first : first + sizes[i]]] == [i] * sizes[i]
    assert sorted(firsts) == sorted(set(firsts))


def test_record_survives_a_flushed_script_cache(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            await store.record_calls("r7", None, [call_record("r7")])
            redis_client.script_flush()  # as after a Redis restart
            second = await store.record_calls("r7", None, [call_record("r7")])
            return second, await store.get_calls("r7")
        finally:
            await store.aclose()

    second, calls = run(go())
    assert second == 1 and len(calls) == 2


def test_a_failed_batch_fails_every_caller_and_none_hangs():
    async def go():
        store = EpisodeStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.5)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(store.record_calls(f"r{i}", None, [call_record(f"r{i}")]) for i in range(20)),
                    return_exceptions=True,
                ),
                timeout=10,
            )
            return results
        finally:
            await store.aclose()

    results = run(go())
    assert len(results) == 20 and all(isinstance(r, StoreUnavailable) for r in results)


def test_a_hung_redis_times_out_for_every_caller_and_never_stalls_the_batcher():
    """A server that accepts connections and never answers: every caller gets StoreUnavailable in time,
    and a later call is not stuck behind the dead batch."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    threading.Thread(
        target=lambda: [accepted.append(listener.accept()) for _ in range(16)], daemon=True
    ).start()

    async def go():
        hung = EpisodeStore.from_url(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.3)
        try:
            first = await asyncio.wait_for(
                asyncio.gather(
                    *(hung.record_calls(f"h{i}", None, [call_record(f"h{i}")]) for i in range(5)),
                    hung.get_rollout("h0"),
                    return_exceptions=True,
                ),
                timeout=5,
            )
            later = await asyncio.wait_for(
                asyncio.gather(hung.record_calls("h9", None, [call_record("h9")]), return_exceptions=True),
                timeout=5,
            )
            return first + later
        finally:
            await hung.aclose()

    results = run(go())
    listener.close()
    assert len(results) == 7 and all(isinstance(r, StoreUnavailable) for r in results), results


def test_a_cancelled_store_call_stays_cancelled(redis_client: redis.Redis):
    """redis-py turns a cancellation in the middle of a command into ConnectionError; the store must not
    turn that into StoreUnavailable, or a cancelled background loop (the gateway's shutdown) never ends."""
    import random

    async def go():
        stuck = 0
        for _ in range(60):
            store = EpisodeStore.from_url(REDIS_URL, prefix="t")

            async def poll(store: EpisodeStore = store) -> None:
                while True:
                    try:
                        await store.policy_version()
                    except StoreUnavailable:
                        pass

            task = asyncio.create_task(poll())
            await asyncio.sleep(random.random() * 0.003)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1)
            if not done:
                stuck += 1
                task.cancel()
            await store.aclose()
        return stuck

    assert run(go()) == 0


@pytest.fixture()
def password_redis(tmp_path):
    """A redis-server of its own that requires a user and password (ACL) and has databases 0-15."""
    import shutil
    import subprocess
    import time

    from conftest import free_port
    from redis_servers import redis_server_command

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        redis_server_command(
            port,
            "--unixsocket",
            str(tmp_path / "redis.sock"),
            "--unixsocketperm",
            "700",
            "--requirepass",
            "default-secret",
            "--user",
            "gw",
            "on",
            ">gw-secret",
            "~*",
            "+@all",
        ),
        stdout=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    client = redis.Redis(port=port, password="default-secret")
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield port
    process.terminate()
    process.wait()


def test_the_record_connection_authenticates_and_selects_the_database(password_redis: int):
    async def go(url: str):
        store = EpisodeStore.from_url(url, prefix="t", timeout_s=2)
        try:
            return await store.record_calls("auth", None, [call_record("auth")])
        finally:
            await store.aclose()

    for url, db in (
        (f"redis://gw:gw-secret@127.0.0.1:{password_redis}/3", 3),
        (f"redis://:default-secret@127.0.0.1:{password_redis}/0", 0),
    ):
        assert run(go(url)) == 0
        client = redis.Redis(port=password_redis, password="default-secret", db=db)
        assert client.llen(Keys("t").calls("auth")) == 1
        client.flushdb()
    with pytest.raises(StoreUnavailable, match="refused"):
        run(go(f"redis://gw:wrong@127.0.0.1:{password_redis}/3"))


def test_a_store_on_a_unix_socket(password_redis: int, tmp_path):
    """`unix:///path?db=N` (the password_redis fixture's socket is in its tmp_path, the test's own): the
    URL reaches redis-py and the record connection as written (it was rewritten to `unix:/path`)."""

    async def go():
        url = f"unix://gw:gw-secret@{tmp_path / 'redis.sock'}?db=4"
        store = EpisodeStore.from_url(url, prefix="t", timeout_s=2)
        try:
            await store.record_calls("sock", None, [call_record("sock")])
            return await store.redis.llen(Keys("t").calls("sock"))
        finally:
            await store.aclose()

    assert run(go()) == 1


def test_every_redis_py_connection_option_is_honoured_or_refused():
    """The hand-written record connection (rlgate/episodes/_batch.py) knows every option of the installed
    redis-py's connections: each is honoured, does not apply, or is refused at start. A redis-py that adds
    an option fails here, not silently in production."""
    import inspect

    import redis.asyncio.connection as connection

    from rlgate.episodes import _batch

    options = set()
    for cls in (connection.Connection, connection.SSLConnection, connection.UnixDomainSocketConnection):
        for klass in cls.__mro__:
            if "__init__" in vars(klass):
                options |= set(inspect.signature(klass.__init__).parameters) - {"self", "args", "kwargs"}
    known = _batch.HONOURED | _batch.NOT_APPLICABLE | _batch.REFUSED
    assert options <= known, sorted(options - known)
    # and what redis-py's clients put into their connections' options, each way the store may be built
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.sentinel import Sentinel

    for client in (
        aioredis.Redis(),
        aioredis.Redis.from_url(f"{REDIS_URL}?socket_timeout=2&client_name=x"),
        aioredis.Redis.from_url("unix:///tmp/redis.sock?db=3"),
        aioredis.Redis.from_url("rediss://localhost:6380/0?ssl_cert_reqs=none&ssl_min_version=772"),
    ):
        _batch.check_options(
            client.connection_pool.connection_kwargs, client.connection_pool.connection_class
        )
    for cluster in (
        RedisCluster(host="localhost", port=7000),
        RedisCluster.from_url("redis://localhost:7000/0?read_from_replicas=true"),
    ):
        _batch.check_options(cluster.nodes_manager.connection_kwargs)  # its READONLY hook is not needed
    sentinel = Sentinel([("localhost", 26379)]).master_for("primary").connection_pool
    with pytest.raises(ValueError, match="does not support Redis Sentinel pools"):
        _batch.check_options(sentinel.connection_kwargs, sentinel.connection_class)
    assert (
        not _batch.HONOURED & _batch.NOT_APPLICABLE
        and not (_batch.HONOURED | _batch.NOT_APPLICABLE) & _batch.REFUSED
    )


def test_an_option_the_record_connection_cannot_honour_is_refused_at_start():
    import redis.asyncio as aioredis

    async def connect_hook(connection):  # redis-py's redis_connect_func: the record connection has none
        await connection.on_connect()

    for client, option in (
        (aioredis.Redis.from_url(REDIS_URL, redis_connect_func=connect_hook), "redis_connect_func"),
        (aioredis.Redis.from_url(f"{REDIS_URL}?no_such_option=1"), "no_such_option"),
    ):
        with pytest.raises(ValueError, match=f"does not support the redis option {option}: leave it out"):
            EpisodeStore(client, Keys("t"))
    EpisodeStore(aioredis.Redis.from_url(f"{REDIS_URL}?protocol=3&socket_timeout=2"), Keys("t"))  # no effect


def test_the_record_connection_takes_a_credential_provider_and_names_itself(password_redis: int):
    """redis-py's credential_provider (rotating credentials: it is asked on every connect) and client_name
    (CLIENT SETNAME, what `CLIENT LIST` shows an operator) are honoured by the record connection too."""
    import redis.asyncio as aioredis
    from redis.credentials import UsernamePasswordCredentialProvider

    asked = []

    class Provider(UsernamePasswordCredentialProvider):
        def get_credentials(self):
            asked.append(1)
            return super().get_credentials()

    async def go():
        client = aioredis.Redis(
            port=password_redis,
            credential_provider=Provider("gw", "gw-secret"),
            client_name="rlgate-recorder",
        )
        store = EpisodeStore(client, Keys("t"), timeout_s=2)
        try:
            await store.record_calls("cred", None, [call_record("cred")])
            return await store._record._pipe.call("CLIENT", "GETNAME")
        finally:
            await store.aclose()

    assert run(go()) == b"rlgate-recorder"
    assert asked  # the provider was asked (the record connection's AUTH used its credentials)
    admin = redis.Redis(port=password_redis, password="default-secret")
    assert admin.llen(Keys("t").calls("cred")) == 1


def test_records_are_batched_per_loop_turn_and_survive_a_killed_connection(redis_client: redis.Redis):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            await store.record_calls("k0", None, [call_record("k0")])
            conn = store._record._pipe._conn
            writes = []
            write = conn.transport.write
            conn.transport.write = lambda data: (writes.append(data), write(data))[1]
            await asyncio.gather(
                *(store.record_calls(f"k{i}", None, [call_record(f"k{i}")]) for i in range(1, 11))
            )
            batches = list(writes)
            # Redis drops the connection (a restart, a failover, `CLIENT KILL`): the next call reconnects.
            # Only this connection is killed: other tests' processes share this Redis.
            client_id = await store._record._pipe.call("CLIENT", "ID")
            redis_client.client_kill_filter(_id=client_id)
            await asyncio.sleep(0.1)
            assert conn.lost
            await store.record_calls("k11", None, [call_record("k11")])
            return batches, store._record._pipe._conn is not conn
        finally:
            await store.aclose()

    writes, reconnected = run(go())
    # the first goes out at once (nothing in flight); the nine that came meanwhile share one write
    assert [w.count(b"EVALSHA") for w in writes] == [1, 9]
    assert reconnected
    assert all(redis_client.llen(Keys("t").calls(f"k{i}")) == 1 for i in range(12))


def test_the_record_size_limit_counts_utf8_bytes(redis_client):
    """`max_bytes` bounds what Redis stores: bytes, not characters (an answer in another script takes 2-4
    bytes a character)."""
    from rlgate.episodes import RecordTooLarge

    async def go():
        store = EpisodeStore.from_url(REDIS_URL)
        try:
            record = call_record("utf8", request={"messages": [{"role": "user", "content": "é" * 3000}]})
            chars, size = len(record.model_dump_json()), len(record.model_dump_json().encode())
            assert chars < 4000 < size
            with pytest.raises(RecordTooLarge):
                await store.record_calls("utf8", None, [record], max_bytes=4000)
            assert not await store.rollout_exists("utf8")
            return await store.record_calls("utf8", None, [record], max_bytes=size)
        finally:
            await store.aclose()

    assert run(go()) == 0
