"""The store on a real Redis Cluster: 3 masters and 3 replicas started from `redis-server` processes in
cluster mode. Every store operation runs on it; the record connection follows MOVED (a failover moved the
slot) and ASK (a slot being migrated); a master killed under load loses no call the gateway answered."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import Proc, call_record, start_gateway
from redis.cluster import RedisCluster as SyncCluster
from redis.crc import key_slot
from redis_servers import cluster_ports
from test_gateway_proxy import MESSAGES, MODEL

from rlgate.episodes import CallRecord, EpisodeStore, Keys, RolloutNotOpen, StoreUnavailable
from rlgate.episodes.export import rollout_ids
from rlgate.episodes.lifecycle import EpisodeLifecycle
from rlgate.episodes.overview import StoreOverview
from rlgate.episodes.stream import ClosedEpisodes

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="needs redis-server and redis-cli",
)

NODE_TIMEOUT_MS = 1000  # how long a master must be silent before its replica takes over


class Cluster:
    """Six `redis-server` processes in cluster mode: 3 masters, each with one replica."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports = cluster_ports(6)
        self.procs: dict[int, subprocess.Popen] = {}
        for port in self.ports:
            self.start(port)
        for port in self.ports:
            self._wait_pong(port)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_healthy()

    def start(self, port: int) -> None:
        work = self.root / str(port)
        work.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
            + ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
            + ["--save", "", "--appendonly", "no", "--logfile", "log"],
            cwd=work,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _wait_pong(self, port: int) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=port, socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise AssertionError(f"redis-server on {port} did not start")

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def client(self) -> SyncCluster:
        alive = next(p for p in self.ports if self.procs[p].poll() is None)
        return SyncCluster(host="127.0.0.1", port=alive, socket_timeout=5)

    def nodes(self) -> list[dict[str, str]]:
        """CLUSTER NODES as seen by a live node: id, port, role, link state and slots of each."""
        alive = next(p for p in self.ports if self.procs[p].poll() is None)
        text = subprocess.run(
            ["redis-cli", "-p", str(alive), "CLUSTER", "NODES"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        nodes = []
        for line in text.splitlines():
            fields = line.split()
            nodes.append(
                {
                    "id": fields[0],
                    "port": fields[1].split("@")[0].rsplit(":", 1)[1],
                    "flags": fields[2],
                    "master_id": fields[3],
                    "link": fields[7],
                    "slots": " ".join(fields[8:]),
                }
            )
        return nodes

    def master_of(self, slot: int) -> int:
        for node in self.nodes():
            if "master" in node["flags"] and "fail" not in node["flags"]:
                for part in node["slots"].split():
                    lo, _, hi = part.partition("-")
                    if not part.startswith("[") and int(lo) <= slot <= int(hi or lo):
                        return int(node["port"])
        raise AssertionError(f"no master serves slot {slot}")

    def _view(self, port: int) -> frozenset[tuple[str, str, str, str, bool]]:
        """What the node on `port` says of every node: (port, role, master id, slots, failing). A slot being
        migrated (`[slot->-id]`, only in its owner's view) is left out."""
        nodes = redis.Redis(port=port, socket_timeout=1).cluster("NODES")  # redis-py parses it
        view = set()
        for address, node in nodes.items():
            role = "master" if "master" in node["flags"] else "replica"
            slots = " ".join("-".join(map(str, span)) for span in node["slots"])  # migrations apart
            view.add(
                (
                    address.split("@")[0].rsplit(":", 1)[1],
                    role,
                    node["master_id"],
                    slots,
                    "fail" in node["flags"],
                )
            )
        return frozenset(view)

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """The cluster is settled: every live node says the cluster is ok, every live replica is in sync
        with its master, every live node's view of every node's role and slots is the same, no view marks a
        live node as failing, and each live node's own role (INFO replication) is the one the views give it.
        Only then may a test act on a role it reads from `nodes()` (a `CLUSTER SETSLOT` sent to a node that
        the views still call a master just after a failover is refused: 'Please use SETSLOT only with
        masters')."""
        deadline = time.monotonic() + timeout_s
        last = "no node answered"
        while time.monotonic() < deadline:
            try:
                live = [p for p in self.ports if self.procs[p].poll() is None]
                if not live:
                    raise AssertionError("no node of the cluster is running")
                views = {port: self._view(port) for port in live}
                problems = []
                for port in live:
                    node = redis.Redis(port=port, socket_timeout=1)
                    if node.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                        problems.append(f"{port}: cluster_state not ok")
                    info = node.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        problems.append(f"{port}: replica link down")
                    own = "master" if info["role"] == "master" else "replica"
                    said = {role for p, role, *_ in views[live[0]] if p == str(port)}
                    if said != {own}:
                        problems.append(f"{port}: is a {own}, the views say {said}")
                if len(set(views.values())) != 1:
                    problems.append("the nodes' views differ")
                if any(failing and int(p) in live for p, *_, failing in views[live[0]]):
                    problems.append("a live node is marked failing")
                if not problems:
                    return
                last = "; ".join(problems)
            except redis.RedisError as exc:  # a node slow to answer (just after SIGCONT) is asked again
                last = repr(exc)
            time.sleep(0.1)
        raise AssertionError(f"the cluster did not settle: {last}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def _cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(_cluster: Cluster) -> Cluster:
    """The module's cluster, settled before each test: whatever roles an earlier test moved (a failover,
    a killed master back as a replica), every node agrees on them before this test reads one."""
    for port, proc in _cluster.procs.items():
        if proc.poll() is not None:
            _cluster.start(port)
        else:
            os.kill(proc.pid, signal.SIGCONT)  # a replica an earlier test stopped and, failing, left stopped
    _cluster.wait_healthy()
    return _cluster


def _ids_on_every_master(cluster: Cluster, n: int) -> list[str]:
    """`n` rollout ids spread evenly over the 3 masters (random ids are drawn until each has its share: 12
    ids drawn at random leave a master without one 2% of the time)."""
    owner: dict[int, int] = {}
    for node in cluster.nodes():
        if "master" in node["flags"] and "fail" not in node["flags"]:
            for slot in _slots(node["slots"]):
                owner[slot] = int(node["port"])
    share = -(-n // 3)
    taken: dict[int, int] = {}
    ids: list[str] = []
    while len(ids) < n:
        rid = f"r{len(ids)}-{uuid.uuid4().hex[:6]}"
        master = owner[key_slot(Keys("c").rollout(rid).encode())]
        if taken.get(master, 0) < share:
            taken[master] = taken.get(master, 0) + 1
            ids.append(rid)
    assert len(taken) == 3, taken
    return ids


def test_every_store_operation_runs_on_a_cluster(cluster: Cluster):
    prefix = f"c{uuid.uuid4().hex[:6]}"
    ids = _ids_on_every_master(cluster, 12)

    async def main() -> None:
        store = EpisodeStore.from_url(cluster.url, prefix=prefix, retention_s=60)
        lifecycle = EpisodeLifecycle(store)
        stream = ClosedEpisodes(store, group="learners")
        try:
            await stream.ensure_group()
            for i, rid in enumerate(ids):
                await store.create_rollout(rid, task_id=f"t{i % 3}")
                indexes = await asyncio.gather(
                    *(store.record_calls(rid, None, [call_record(rid)]) for _ in range(3))
                )
                assert sorted(indexes) == [0, 1, 2]
            stats = store.record_stats()
            assert stats["connects"] == 3 and stats["commands"] >= 36  # one connection per master
            view = await store.get_rollout_view(ids[0])
            assert view is not None and len(view.calls) == 3 and view.task_id == "t0"
            listing = await store.list_rollouts(limit=100)
            assert {r.rollout_id for r in listing.rollouts} == set(ids)
            await lifecycle.set_call_reward(ids[0], 1, 0.5)
            for rid in ids[:6]:
                assert (await lifecycle.close(rid, 1.0)).outcome == "closed"
            assert await lifecycle.fail(ids[6], "crashed")
            with pytest.raises(RolloutNotOpen):
                await store.record_calls(ids[0], None, [call_record(ids[0])])
            episodes = await stream.read("learner-0", count=100, block_ms=100)
            assert sorted(e.rollout_id for e in episodes) == sorted(ids[:6])
            for episode in episodes:
                assert await stream.claim(episode, "learner-0", 30) == "claimed"
                assert await stream.ack(episode)
            assert await store.backlog(None, "learners") == 0
            consumed = await store.get_rollout(ids[0])
            assert consumed is not None and consumed.status == "consumed"
            assert await store.redis.pttl(store.keys.calls(ids[0])) > 0  # retention set on a cluster too
            await store.set_policy_version(3)
            assert await store.policy_version() == 3
            assert await store.epoch(create=True)
            await store.check_writable()
            assert sorted([rid async for rid in rollout_ids(store)]) == sorted(ids)  # SCAN on every master
            overview = StoreOverview(store)  # the dashboard's reads
            counts = await overview.counts()
            assert counts.indexed == 12 and counts.stream_length == 6 and counts.has_group
            listing = await store.list_rollouts(limit=100)  # one HMGET and LLEN per rollout, on its master
            assert {(r.rollout_id, r.calls, r.first_version, r.last_version) for r in listing.rollouts} == {
                (rid, 3, 0, 0) for rid in ids
            }
        finally:
            await store.aclose()

    asyncio.run(main())


def test_the_record_connection_follows_moved_and_ask(cluster: Cluster):
    prefix = f"c{uuid.uuid4().hex[:6]}"
    client = cluster.client()

    async def record(store: EpisodeStore, rid: str) -> int:
        return await store.record_calls(rid, None, [call_record(rid)])

    # MOVED: a manual failover turns the slot's master into a replica, which answers MOVED
    # (with wait_replicas=1: the old master, a replica now, answers MOVED to the script and refuses the
    # WAIT behind it, and the call follows the MOVED)
    moved = f"m-{uuid.uuid4().hex[:6]}"
    slot = key_slot(Keys(prefix).rollout(moved).encode())
    store = EpisodeStore.from_url(f"{cluster.url}/?wait_replicas=1", prefix=prefix)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(record(store, moved)) == 0
        old = cluster.master_of(slot)
        replica = next(
            int(n["port"])
            for n in cluster.nodes()
            if n["master_id"] == next(m["id"] for m in cluster.nodes() if int(m["port"]) == old)
        )
        redis.Redis(port=replica).execute_command("CLUSTER FAILOVER")
        deadline = time.monotonic() + 20
        while cluster.master_of(slot) != replica and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.master_of(slot) == replica
        cluster.wait_healthy()
        refreshes = store._record._nodes.refreshes
        assert loop.run_until_complete(record(store, moved)) == 1  # sent to the old master, MOVED, resent
        assert store._record._nodes.refreshes == refreshes + 1
        assert loop.run_until_complete(record(store, moved)) == 2
        assert client.llen(store.keys.calls(moved)) == 3
    finally:
        loop.run_until_complete(store.aclose())

    # ASK: the slot of a new rollout is being migrated. Its old owner answers ASK (the keys are not there);
    # the importing node, asked with ASKING, answers TRYAGAIN (a multi-key script on keys it does not hold
    # yet) until the migration ends: the call waits for that and lands on the new owner.
    while True:  # a rollout whose slot holds no key yet (earlier tests' keys would make the source answer)
        asked = f"a-{uuid.uuid4().hex[:6]}"
        slot = key_slot(Keys(prefix).rollout(asked).encode())
        source = cluster.master_of(slot)
        if redis.Redis(port=source).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0:
            break
    target = next(
        int(n["port"]) for n in cluster.nodes() if "master" in n["flags"] and int(n["port"]) != source
    )
    ids = {int(n["port"]): n["id"] for n in cluster.nodes()}
    redis.Redis(port=target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    redis.Redis(port=source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])

    def finish_migration() -> None:
        time.sleep(0.5)
        for port in (target, source):  # the slot belongs to the target now
            redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])

    async def record_during_migration(store: EpisodeStore) -> tuple[int, float]:
        started = time.monotonic()
        index, _ = await asyncio.gather(record(store, asked), asyncio.to_thread(finish_migration))
        return index, time.monotonic() - started

    store = EpisodeStore.from_url(f"{cluster.url}/?wait_replicas=1", prefix=prefix)
    try:
        index, took = loop.run_until_complete(record_during_migration(store))
        assert index == 0 and took >= 0.5
        assert redis.Redis(port=source).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        assert redis.Redis(port=target).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 2
    finally:
        loop.run_until_complete(store.aclose())
        loop.close()
    cluster.wait_healthy()
    assert cluster.master_of(slot) == target
    assert client.llen(Keys(prefix).calls(asked)) == 1
    client.close()


def test_a_killed_master_loses_no_answered_call(cluster: Cluster, fake_vllm: Proc, tmp_path: Path):
    """Agents call the gateway (wait_replicas=1) while the master of a third of the slots is killed:
    every call answered 200 is in the store after its replica took over; calls fail only for the moments
    of the failover (503, never a silent success), and succeed again after it."""
    prefix = f"c{uuid.uuid4().hex[:6]}"
    cluster.wait_healthy()
    gateway = start_gateway(
        tmp_path,
        fake_vllm.url,
        redis_url=f"{cluster.url}/?wait_replicas=1",
        key_prefix=prefix,
        redis_timeout_s="3",
    )
    ids = _ids_on_every_master(cluster, 24)
    slot = key_slot(Keys(prefix).rollout(ids[0]).encode())
    victim = cluster.master_of(slot)
    on_victim = {
        rid for rid in ids if cluster.master_of(key_slot(Keys(prefix).rollout(rid).encode())) == victim
    }
    answered: dict[str, list[str]] = {rid: [] for rid in ids}
    failed: list[int] = []
    stop = threading.Event()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
            agents = [pool.submit(_agent, gateway.url, rid, answered[rid], failed, stop) for rid in ids]
            # conditions, not timings: a loaded machine only makes them take longer
            _wait_for(
                lambda: all(len(v) >= 3 for v in answered.values()), "every agent answered before the kill"
            )
            took_over = _kill_and_wait_for_takeover(cluster, victim, slot)
            at_takeover = {rid: len(v) for rid, v in answered.items()}
            # the new master has no replica: wait_replicas=1 refuses its writes (503) until one is back;
            # the other masters' rollouts go on
            _wait_for(
                lambda: all(len(answered[rid]) > at_takeover[rid] for rid in ids if rid not in on_victim),
                "the other masters' agents answered after the takeover",
            )
            # and the agents on the new master are refused (503) while it has no replica: waited for, since
            # their calls may still be in flight from before the takeover (the failed master's timeout)
            _wait_for(lambda: bool(failed), "a call on the new master refused while it had no replica")
            degraded = {rid: len(answered[rid]) - at_takeover[rid] for rid in on_victim}
            cluster.start(victim)  # back, as a replica of the node that took over
            cluster.wait_healthy()
            at_rejoin = {rid: len(v) for rid, v in answered.items()}
            # with a replica again, every agent on every master (the new one too) is answered again
            _wait_for(
                lambda: all(len(answered[rid]) > at_rejoin[rid] for rid in ids),
                "every agent answered after the old master rejoined",
            )
            stop.set()
            for future in agents:
                future.result()
        assert degraded == {rid: 0 for rid in on_victim}, degraded
        assert failed, "the failover refused no call: was a master killed?"
        _check_every_answered_call_stored(cluster, prefix, answered)
        print(
            f"answered {sum(map(len, answered.values()))}, refused {len(failed)} (503), takeover {took_over:.1f} s"
        )
    finally:
        stop.set()
        gateway.kill()
        if cluster.procs[victim].poll() is not None:
            cluster.start(victim)
        cluster.wait_healthy()


def _agent(gateway_url: str, rid: str, answered: list[str], failed: list[int], stop: threading.Event) -> None:
    """Calls the gateway in rollout `rid` until `stop`: the texts of calls answered 200 go to `answered`,
    refusals (503, nothing else) to `failed`."""
    with httpx.Client(timeout=30) as http:
        n = 0
        while not stop.is_set():
            text = f"{rid} call {n}"
            n += 1
            response = http.post(
                f"{gateway_url}/rollouts/{rid}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [*MESSAGES[:1], {"role": "user", "content": text}],
                    "max_tokens": 2,
                },
            )
            if response.status_code == 200:
                answered.append(text)
            else:
                assert response.status_code == 503, response.text
                failed.append(response.status_code)
                time.sleep(0.05)


def _kill_and_wait_for_takeover(cluster: Cluster, victim: int, slot: int) -> float:
    """SIGKILL the master `victim` (no goodbye to its replica or the gateway); the seconds until another
    node serves `slot`."""
    cluster.procs[victim].kill()
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < 30 and _master_or_none(cluster, slot) in (victim, None):
        time.sleep(0.1)
    took_over = time.monotonic() - killed_at
    assert cluster.master_of(slot) != victim, "no replica took over"
    return took_over


def _check_every_answered_call_stored(cluster: Cluster, prefix: str, answered: dict[str, list[str]]) -> None:
    client = cluster.client()
    try:
        for rid, texts in answered.items():
            stored = [
                CallRecord.model_validate_json(raw).request["messages"][-1]["content"]
                for raw in client.lrange(Keys(prefix).calls(rid), 0, -1)
            ]
            missing = set(texts) - set(stored)
            assert not missing, f"{rid}: answered but lost {sorted(missing)[:3]}"
    finally:
        client.close()


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.05)


def _master_or_none(cluster: Cluster, slot: int) -> int | None:
    try:
        return cluster.master_of(slot)
    except (AssertionError, subprocess.SubprocessError):
        return None


def _slots(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split():
        if part.startswith("["):
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_cluster_urls_and_what_needs_a_standalone_redis(cluster: Cluster, fake_vllm: Proc, tmp_path: Path):
    from test_cli import rlgate

    from rlgate.episodes.store import parse_url

    assert parse_url("redis+cluster://h:7000/?wait_replicas=2") == ("redis://h:7000/", True, 2)
    assert parse_url("rediss://u:p@h:6380/3?ssl_cert_reqs=none") == (
        "rediss://u:p@h:6380/3?ssl_cert_reqs=none",
        False,
        0,
    )
    for bad, says in [
        ("redis+cluster://h:7000/2", "database 0 only"),
        ("redis://h/0?wait_replicas=x", "wait_replicas"),
        ("redis://h/0?wait_replicas=99", "wait_replicas"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_url(bad)
        result = rlgate("gateway", env={"RLGATE_REDIS_URL": bad})  # one line, no traceback
        assert result.returncode != 0 and says in result.stderr and "Traceback" not in result.stderr
    # rq does not run on a cluster: the worker says what to set; the gateway answers finish with 503
    result = rlgate("worker", "--burst", env={"RLGATE_REDIS_URL": cluster.url})
    assert result.returncode != 0 and "RLGATE_QUEUE_REDIS_URL" in result.stderr
    assert "Traceback" not in result.stderr
    prefix = f"c{uuid.uuid4().hex[:6]}"
    gateway = start_gateway(tmp_path, fake_vllm.url, redis_url=cluster.url, key_prefix=prefix)
    try:
        url = f"{gateway.url}/rollouts/f1/v1/chat/completions"
        assert (
            httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).status_code == 200
        )
        finish = httpx.post(f"{gateway.url}/rollouts/f1/finish", json={"reward_fn": "exact_match"})
        assert finish.status_code == 503 and finish.json()["error"]["code"] == "no_reward_queue"
        reward = httpx.post(f"{gateway.url}/rollouts/f1/reward", json={"reward": 1})
        assert reward.status_code == 200 and reward.json()["outcome"] == "closed"
    finally:
        gateway.kill()


def test_waiting_for_a_stalled_replica_is_bounded_and_cancellation_is_per_caller(cluster: Cluster):
    """With its replica stopped (SIGSTOP) a master's WAITs come back short: the calls fail with 503's
    StoreUnavailable after at most two WAITs (half the timeout each) however many batches queue behind, and
    a caller cancelled while waiting leaves the others sharing its WAIT with their own answer."""
    prefix = f"c{uuid.uuid4().hex[:6]}"
    rid = f"w-{uuid.uuid4().hex[:6]}"
    master = cluster.master_of(key_slot(Keys(prefix).rollout(rid).encode()))
    master_id = next(n["id"] for n in cluster.nodes() if int(n["port"]) == master)
    replica = next(int(n["port"]) for n in cluster.nodes() if n["master_id"] == master_id)
    store = EpisodeStore.from_url(f"{cluster.url}/?wait_replicas=1", prefix=prefix, timeout_s=2)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert await store.record_calls(rid, None, [call_record(rid)]) == 0  # connected, script loaded
        os.kill(cluster.procs[replica].pid, signal.SIGSTOP)
        try:
            first = asyncio.create_task(store.record_calls(rid, None, [call_record(rid)]))
            await asyncio.sleep(0)  # written at once, with a WAIT: in flight
            cancelled = asyncio.create_task(store.record_calls(rid, None, [call_record(rid)]))
            sharing = asyncio.create_task(
                store.record_calls(rid, None, [call_record(rid)])
            )  # the same next WAIT
            more = []
            for _ in range(8):  # eight more batches, one per loop turn, behind the stalled WAIT
                await asyncio.sleep(0)
                more.append(asyncio.create_task(store.record_calls(rid, None, [call_record(rid)])))
            started = loop.time()
            # the first WAIT returns short at 1 s; then the batch of `cancelled` and `sharing` has its replies
            # and both wait on the second WAIT: cancel one then
            await asyncio.sleep(1.5)
            cancelled.cancel()
            results = await asyncio.gather(first, sharing, *more, return_exceptions=True)
            took = loop.time() - started
            assert cancelled.cancelled()
            assert all(isinstance(r, StoreUnavailable) and "replicas confirmed" in str(r) for r in results), (
                results
            )
            # two WAITs of 1 s (~2 s), not one per batch (~10 s); loose enough for a loaded machine
            assert took < 6.0, took
        finally:
            os.kill(cluster.procs[replica].pid, signal.SIGCONT)
        await asyncio.to_thread(cluster.wait_healthy)
        # the writes are on the master (the callers were told they may not be replicated), and recording
        # goes on once the replica is back
        assert await store.record_calls(rid, None, [call_record(rid)]) == 12
        await store.aclose()

    asyncio.run(main())


def test_a_reward_is_answered_only_once_the_replicas_hold_it(cluster: Cluster):
    """With `?wait_replicas=1` a reward is answered only once replicas hold the closer's outbox intent, the
    close and its stream entry (an intermediate reward: its write): with the replica of the outbox's
    master stopped nothing is closed; with the replica of the rollout's master stopped the close (and an
    intermediate reward) is not confirmed; with the replica of the stream's master stopped the entry is
    not. Each time the sender hears 503's StoreUnavailable and retries; a closed episode whose entry was
    not confirmed reaches the stream through the sweeper's outbox repair (at least once)."""

    def master(key: str) -> int:
        return cluster.master_of(key_slot(key.encode()))

    while True:  # the outbox and the stream on masters of their own, so each phase stops one thing
        keys = Keys(f"c{uuid.uuid4().hex[:6]}")
        if master(keys.outbox) != master(keys.episodes):
            break

    def replica_of(port: int) -> int:
        master_id = next(n["id"] for n in cluster.nodes() if int(n["port"]) == port)
        return next(int(n["port"]) for n in cluster.nodes() if n["master_id"] == master_id)

    globals_ = {master(keys.episodes), master(keys.outbox)}

    def rollout_off(ports: set[int]) -> str:
        while True:
            rid = f"d-{uuid.uuid4().hex[:6]}"
            if master(keys.rollout(rid)) not in ports:
                return rid

    store = EpisodeStore.from_url(f"{cluster.url}/?wait_replicas=1", prefix=keys.prefix, timeout_s=2)
    lifecycle = EpisodeLifecycle(store)
    other = EpisodeStore.from_url(f"{cluster.url}/?wait_replicas=1", prefix=keys.prefix, timeout_s=2)

    async def with_replica_stopped(port: int, *work: Any) -> None:
        os.kill(cluster.procs[port].pid, signal.SIGSTOP)
        try:
            for job in work:
                with pytest.raises(StoreUnavailable):
                    await job()
        finally:
            os.kill(cluster.procs[port].pid, signal.SIGCONT)
        await asyncio.to_thread(cluster.wait_healthy)

    def stream() -> list[str]:
        return [f[b"rollout_id"].decode() for _, f in cluster.client().xrange(keys.episodes)]

    async def status(rid: str) -> str:
        rollout = await store.get_rollout(rid)
        assert rollout is not None
        return rollout.status.value

    async def main() -> None:
        # the outbox's master's replica stopped: the intent is not confirmed, nothing is closed
        quiet = rollout_off(globals_)
        await store.record_calls(quiet, "t", [call_record(quiet)])
        await with_replica_stopped(replica_of(master(keys.outbox)), lambda: lifecycle.close(quiet, 1.0))
        assert await status(quiet) == "open"
        assert (await lifecycle.close(quiet, 1.0)).outcome == "closed"
        first, second = rollout_off(globals_), rollout_off(globals_)
        for rid in (first, second):
            await store.record_calls(rid, "t", [call_record(rid)])
        # the rollout's master's replica stopped: the intermediate reward and the close unconfirmed
        await with_replica_stopped(
            replica_of(master(keys.rollout(first))),
            lambda: lifecycle.set_call_reward(first, 0, 0.5),
            lambda: lifecycle.close(first, 1.0),
            # the sender's retry through another process's connections, which wrote nothing yet (Redis
            # 7.0 WAITs there for the server's offset anyway; later versions count the caller's own writes)
            lambda: EpisodeLifecycle(other).close(first, 1.0),
        )
        assert first not in stream()
        assert (await lifecycle.close(first, 1.0)).outcome == "unchanged"  # the sender's retry
        # the stream's master's replica stopped: the close confirmed, its stream entry not
        await with_replica_stopped(replica_of(master(keys.episodes)), lambda: lifecycle.close(second, 0.5))
        assert second in stream()  # on the master, not known to be on its replica
        assert (await lifecycle.close(second, 0.5)).outcome == "unchanged"
        assert sorted(await lifecycle.repair_outbox(grace_s=0)) == sorted([first, second])
        assert sorted(r for r in stream() if r in (first, second)) == sorted(
            [first, second, second]
        )  # at least once
        view = await store.get_rollout_view(first)
        assert view is not None and view.calls[0].reward == 0.5  # written, though not confirmed then
        # with the replicas up a close answers at once, and a replica holds it when it does
        third = rollout_off(set())
        await store.record_calls(third, "t", [call_record(third)])
        assert (await lifecycle.close(third, 0.25)).outcome == "closed"
        replica = redis.Redis(port=replica_of(master(keys.rollout(third))), single_connection_client=True)
        try:
            replica.execute_command("READONLY")
            assert replica.hget(keys.rollout(third), "status") == b"closed"
        finally:
            replica.close()

    async def run() -> None:
        try:
            await main()
        finally:
            await store.aclose()
            await other.aclose()

    asyncio.run(run())


@pytest.mark.slow
def test_a_learner_step_on_a_cluster(cluster: Cluster, tmp_path: Path):
    """The whole loop with every service on the cluster: the gateway records, rewards close, the learner
    reads the stream, trains one step, pushes an adapter to `rlgate serve`, moves the policy pointer, and
    the gateway serves the next call with it."""
    from conftest import start_rlgate_serve
    from test_learner_e2e import BIAS, SERVE_KEY, episode, learner, steps
    from test_learner_e2e import MODEL as SERVED

    from rlgate.inference.tiny_model import build_tiny_model

    prefix = f"c{uuid.uuid4().hex[:6]}"
    model = build_tiny_model(tmp_path / "tiny", seed=3)
    serve = start_rlgate_serve(model, tmp_path, SERVED, lora=True, weights_root=tmp_path, api_key=SERVE_KEY)
    url = f"{cluster.url}/?wait_replicas=1"
    gateway = start_gateway(
        tmp_path,
        serve.url + "/v1",
        redis_url=url,
        key_prefix=prefix,
        policy_poll_s="0.05",
        upstream_api_key=SERVE_KEY,
    )
    try:
        rids = [episode(gateway, task, r) for task in ("add-1", "add-2") for r in (1.0, 0.0, 0.0, 1.0)]
        out = tmp_path / "learner"
        proc = learner(model, serve, out, redis_url=url, key_prefix=prefix)
        assert proc.wait(timeout=300) == 0, (out.parent / "learner.log").read_text()[-4000:]
        [step] = steps(out)
        assert step["policy_version"] == 1 and step["episodes"] == 8 and step["samples"] == 16
        client = cluster.client()
        try:
            keys = Keys(prefix)
            assert all(client.hget(keys.rollout(rid), "status") == b"consumed" for rid in rids)
            assert client.xpending(keys.episodes, "learners")["pending"] == 0
            assert client.hget(keys.policy, "adapter") == b"policy-v1"
        finally:
            client.close()
        deadline = time.monotonic() + 10
        while True:  # the gateway polls the pointer
            rid = uuid.uuid4().hex
            answer = httpx.post(
                f"{gateway.url}/rollouts/{rid}/v1/chat/completions",
                json={"model": SERVED, "messages": MESSAGES, "max_tokens": 2, "logit_bias": BIAS},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            [call] = httpx.get(f"{gateway.url}/rollouts/{rid}", timeout=10).json()["calls"]
            if call["policy_version"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert call["policy_version"] == 1 and call["model"] == "policy-v1"
    finally:
        gateway.kill()
        serve.kill()
