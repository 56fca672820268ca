"""`rlgate gateway --workers N`: real worker processes behind one port, real HTTP, the real Redis. Calls
spread over the workers and are all recorded, /metrics sums every worker's, a dead worker is replaced,
SIGTERM (or the supervisor's death) leaves nothing behind, one sweeper sweeps for all of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis
from conftest import REDIS_URL, Proc, free_port, rlgate, start_gateway
from test_gateway_proxy import MESSAGES, MODEL, rollout

from reward_hooks.sweeper import SweeperLease
from rlgate.episodes import EpisodeStore


def events(proc: Proc, name: str) -> list[dict]:
    lines = (json.loads(line) for line in proc.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == name]


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.05)
    return value


def metric(text: str, sample: str) -> float:
    """The value of one sample line of a Prometheus text page (0 when absent)."""
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def stop(proc: Proc) -> None:
    try:
        proc.kill(signal.SIGTERM)
    except subprocess.TimeoutExpired:
        proc.kill()


def started(proc: Proc) -> dict:
    """The supervisor's start line, once every worker it names has started its gateway."""
    line = wait_for(lambda: events(proc, "gateway_workers_started"), "the supervisor's start line")[0]
    wait_for(
        lambda: {e["pid"] for e in events(proc, "gateway_started")} >= set(line["pids"]), "every worker up"
    )
    return line


def call(base: str, rollout_id: str, seed: int, stream: bool = False) -> int:
    """One call on a connection of its own (the kernel picks a worker per connection)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "seed": seed, "stream": stream}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{base}/rollouts/{rollout_id}/v1/chat/completions", json=body) as r:
            r.read()
            return r.status_code


OK_CALLS = 'rlgate_gateway_calls_total{endpoint="chat.completions",outcome="ok"}'


def test_calls_spread_over_the_workers_are_all_recorded_and_metrics_sum_them(
    fake_vllm: Proc, tmp_path, redis_client
):
    proc = start_gateway(tmp_path, fake_vllm.url, workers="2")
    try:
        pids = set(started(proc)["pids"])
        assert len(pids) == 2 and proc.process.pid not in pids
        rollouts = [f"w-{uuid.uuid4().hex[:8]}-{i}" for i in range(20)]

        def agent(rollout_id: str) -> list[int]:  # one agent: its calls in order, each on a new connection
            return [call(proc.url, rollout_id, seed, stream=seed % 3 == 0) for seed in range(8)]

        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            statuses = [s for agent_statuses in pool.map(agent, rollouts) for s in agent_statuses]
        assert statuses == [200] * 160
        completion_tokens = 0
        for rollout_id in rollouts:
            calls = rollout(proc, rollout_id)["calls"]
            assert [c["index"] for c in calls] == list(range(8))
            assert [c["request"]["seed"] for c in calls] == list(range(8))
            completion_tokens += sum(len(c["completion_token_ids"]) for c in calls)
        assert completion_tokens > 160
        # every call's canonical line came from one of the two workers, and both took a share
        served = wait_for(
            lambda: (c := Counter(e["pid"] for e in events(proc, "call"))).total() == 160 and c, "logs"
        )
        assert set(served) == pids and min(served.values()) > 0
        # whichever worker answers /metrics (each scrape on a new connection), it counts all of them
        for _ in range(6):
            page = wait_for(
                lambda: (t := httpx.get(f"{proc.url}/metrics").text) and metric(t, OK_CALLS) == 160 and t,
                "metrics",
            )
            assert metric(page, 'rlgate_gateway_tokens_total{kind="completion"}') == completion_tokens
            latency_counts = re.findall(
                r"^rlgate_gateway_call_latency_seconds_count\{.*\} (\S+)$", page, re.MULTILINE
            )
            assert sum(float(v) for v in latency_counts) == 160
            assert metric(page, "rlgate_gateway_store_latency_seconds_count") == 160
            assert "pid=" not in page  # gauges summed across workers, not one series per process
        # the scrape-time values are each worker's own, summed: every worker holds its record connection
        wait_for(
            lambda: (
                metric(httpx.get(f"{proc.url}/metrics").text, "rlgate_gateway_record_connects_total") == 2
            ),
            "both workers' record connections in the metrics",
        )
    finally:
        stop(proc)


def test_sigterm_stops_every_worker_and_leaves_nothing_behind(fake_vllm: Proc, tmp_path, redis_client):
    control_port = free_port()
    proc = start_gateway(tmp_path, fake_vllm.url, workers="3", control_port=str(control_port))
    control = f"http://127.0.0.1:{control_port}"
    try:
        start = started(proc)
        pids, metrics_dir = start["pids"], Path(start["metrics_dir"])
        assert len(pids) == 3 and all(alive(pid) for pid in pids) and metrics_dir.is_dir()
        assert call(proc.url, "sigterm", 0) == 200
        assert metric(httpx.get(f"{control}/metrics").text, OK_CALLS) == 1
        proc.kill(signal.SIGTERM)
        assert proc.process.returncode == 0, proc.log()
        assert [pid for pid in pids if alive(pid)] == []
        assert not metrics_dir.exists()
        stopped = events(proc, "gateway_workers_stopped")
        assert [e["clean"] for e in stopped] == [True]
        for url in (proc.url, control):
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/healthz")
    finally:
        stop(proc)


def test_a_dead_worker_is_replaced_and_a_dead_supervisor_takes_its_workers_along(
    fake_vllm: Proc, tmp_path, redis_client
):
    proc = start_gateway(tmp_path, fake_vllm.url, workers="2")
    try:
        start = started(proc)
        pids, metrics_dir = start["pids"], Path(start["metrics_dir"])
        for seed in range(20):
            assert call(proc.url, "before", seed) == 200
        os.kill(pids[0], signal.SIGKILL)
        restarted = wait_for(lambda: events(proc, "gateway_worker_restarted"), "a replacement worker")
        assert [e["worker"] for e in events(proc, "gateway_worker_died")] == [0]
        new_pid = restarted[0]["pid"]
        assert new_pid not in pids and alive(new_pid) and alive(pids[1])
        # the replacement serves (it may still be starting: its socket queues connections until then)
        wait_for(
            lambda: any(e["pid"] == new_pid for e in events(proc, "gateway_started")), "the replacement up"
        )
        for seed in range(20):
            assert call(proc.url, "after", seed) == 200
        assert len(rollout(proc, "before")["calls"]) == 20 and len(rollout(proc, "after")["calls"]) == 20
        # the dead worker's counts are kept: /metrics still counts every call
        wait_for(lambda: metric(httpx.get(f"{proc.url}/metrics").text, OK_CALLS) == 40, "40 calls counted")
        # a supervisor killed outright: its workers follow it (no orphans serving the port)
        proc.kill(signal.SIGKILL)
        wait_for(lambda: not alive(new_pid) and not alive(pids[1]), "the workers gone with their supervisor")
        assert metrics_dir.is_dir()  # it could not clean up; the next supervisor does
        next_one = start_gateway(tmp_path, fake_vllm.url, workers="2")
        try:
            assert Path(started(next_one)["metrics_dir"]).is_dir() and not metrics_dir.exists()
        finally:
            stop(next_one)
    finally:
        stop(proc)


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("taken", ["agent", "control", "agent by SO_REUSEPORT"])
def test_a_taken_port_is_one_line_and_exit_status_1(workers: str, taken: str, tmp_path):
    holder = socket.socket()
    if taken == "agent by SO_REUSEPORT":  # as another gateway's workers hold it: never shared with them
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    agent, control = (free_port(), port) if taken == "control" else (port, free_port())
    env = {
        **os.environ,
        "RLGATE_REDIS_URL": REDIS_URL,
        "RLGATE_WORKERS": workers,
        "RLGATE_PORT": str(agent),
        "RLGATE_CONTROL_PORT": str(control),
        "RLGATE_LOG_FORMAT": "json",
    }
    try:
        result = rlgate("gateway", env=env, timeout=60)
    finally:
        holder.close()
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert errors == [f"ERROR uvicorn.error: cannot listen on 127.0.0.1 port {port}: Address already in use"]
    assert "Traceback" not in result.stderr and "gateway_workers_started" not in result.stderr
    assert "gateway_started" not in result.stderr  # nothing started: both ports are bound first


def test_one_sweeper_sweeps_for_every_worker(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(
        tmp_path,
        fake_vllm.url,
        workers="2",
        rollout_ttl_s="0.3",
        sweep_interval_s="0.1",
        expired_fill_reward="0",
        key_prefix="wsweep",  # a deployment of its own: the session gateways' sweeper is not in it
    )
    try:
        pids = started(proc)["pids"]
        rollouts = [f"sweep-{i}" for i in range(12)]
        for i, rollout_id in enumerate(rollouts):
            assert call(proc.url, rollout_id, i) == 200
        # closed with the fill reward at their TTL, each published exactly once
        wait_for(lambda: all(rollout(proc, r)["status"] == "closed" for r in rollouts), "all closed")
        published = [f[b"rollout_id"].decode() for _, f in redis_client.xrange("wsweep:episodes")]
        assert sorted(published) == sorted(rollouts)
        holder = redis_client.get("wsweep:sweeper").decode()
        assert int(holder.split(":")[1]) in pids
        taken = events(proc, "sweeper_lease_taken")
        assert [e["pid"] for e in taken] == [int(holder.split(":")[1])]
    finally:
        stop(proc)


def test_the_sweeper_lease_has_one_holder_and_passes_on():
    async def scenario() -> list[bool]:
        prefix = f"lease-{uuid.uuid4().hex[:8]}"  # not the session gateways' lease
        stores = [EpisodeStore.from_url(REDIS_URL, prefix=prefix) for _ in range(2)]
        try:
            await stores[0].redis.delete(stores[0].keys.sweeper)
            a, b = (SweeperLease(store, lease_s=30) for store in stores)
            seen = [await a.hold(), await b.hold(), await a.hold(), await b.hold()]
            await b.release()  # not b's to release
            seen.append(await b.hold())
            await a.release()  # a process that stops hands it on at once
            seen += [await b.hold(), await a.hold()]
            short = SweeperLease(stores[0], lease_s=0.2)
            await b.release()
            seen.append(await short.hold())
            deadline = time.monotonic() + 30
            while not await b.hold():  # a holder that stops renewing loses it when the lease runs out
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            seen.append(await short.hold())
            await stores[0].redis.delete(stores[0].keys.sweeper)
            return seen
        finally:
            for store in stores:
                await store.aclose()

    assert asyncio.run(scenario()) == [True, False, True, False, False, True, False, True, False]
