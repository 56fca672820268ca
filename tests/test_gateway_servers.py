"""Several inference servers behind one gateway (`gateway.servers`), all real processes: two fake vLLMs, the
gateway with `upstream_urls`, Redis. Every call of a rollout lands on one server, rollouts spread over both,
a server killed mid-run loses no answered call and its rollouts go on on the other; a server that has not
loaded the pointer's policy version gets no calls."""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from conftest import Proc, start_fake_vllm, start_gateway

MODEL = "fake-model"


@pytest.fixture
def two(tmp_path) -> Iterator[tuple[Proc, Proc, Proc]]:
    a, b = start_fake_vllm(tmp_path, "--model", MODEL), start_fake_vllm(tmp_path, "--model", MODEL)
    gateway = start_gateway(
        tmp_path, a.url, upstream_urls=json.dumps([a.url, b.url]), upstream_health_interval_s="0.2"
    )
    yield gateway, a, b
    for proc in (gateway, a, b):
        proc.kill(signal.SIGTERM)


def name(proc: Proc) -> str:
    return proc.url.removesuffix("/v1")


def call(gateway: Proc, rid: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/rollouts/{rid}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": f"turn of {rid}"}], "max_tokens": 4},
        timeout=30,
    )


def records(gateway: Proc, rid: str) -> list[dict]:
    return httpx.get(f"{gateway.url}/rollouts/{rid}", timeout=10).json()["calls"]


def test_rollouts_stick_to_one_server_spread_over_both_and_survive_one_dying(two, redis_client):
    gateway, a, b = two
    rids = [uuid.uuid4().hex for _ in range(8)]
    answered: dict[str, int] = dict.fromkeys(rids, 0)
    for _ in range(3):
        for rid in rids:
            assert call(gateway, rid).status_code == 200
            answered[rid] += 1
    placed = {rid: {c["server"] for c in records(gateway, rid)} for rid in rids}
    assert all(len(servers) == 1 for servers in placed.values()), placed  # sticky
    assert {s for servers in placed.values() for s in servers} == {name(a), name(b)}  # both used
    # the choice is kept with the rollout, for every gateway process
    rid = rids[0]
    assert redis_client.get(f"rlgate:rollout:{{{rid}}}:server").decode() in placed[rid]

    a.kill(signal.SIGKILL)
    on_a = [rid for rid in rids if placed[rid] == {name(a)}]
    assert on_a
    failed = 0
    deadline = time.monotonic() + 10
    for rid in rids:  # calls right after the kill may fail (502, recorded); within seconds they go to b
        while True:
            answer = call(gateway, rid)
            if answer.status_code == 200:
                answered[rid] += 1
                break
            assert answer.status_code in (502, 503), answer.text
            failed += 1
            assert time.monotonic() < deadline, "the rollouts of the dead server did not move"
            time.sleep(0.1)
    for rid in rids:
        calls = records(gateway, rid)
        ok = [c for c in calls if c["error"] is None]
        assert len(ok) == answered[rid]  # no answered call lost
        assert ok[-1]["server"] == name(b)
        if rid in on_a:
            assert ok[-1]["rerouted_from"] == name(a)  # its context was prefilled again on b: said so
    health = httpx.get(f"{gateway.url}/healthz", timeout=10).json()
    assert {s["server"]: s["healthy"] for s in health["servers"]} == {name(a): False, name(b): True}
    # the dashboard's overview shows each server (its table rows, parsed as a browser would read them)
    page = httpx.get(f"{gateway.url}/ui?fragment=1", timeout=10).text
    rows = re.findall(r'<tr data-server="([^"]+)"><td>[^<]*</td><td>(up|down)</td>', page)
    assert dict(rows) == {name(a): "down", name(b): "up"}


def test_a_server_behind_on_the_policy_version_gets_no_calls(two, redis_client: redis.Redis):
    gateway, a, b = two
    # the learner loaded version 3 on b only (a failed its push); the pointer names version 3
    redis_client.hset("rlgate:servers:versions", mapping={name(a): 2, name(b): 3})
    redis_client.hset("rlgate:policy", mapping={"version": 3, "adapter": "", "base_model": "", "draining": 0})
    time.sleep(0.6)  # the gateway's policy poll and health loop
    rids = [uuid.uuid4().hex for _ in range(6)]
    for rid in rids:
        assert call(gateway, rid).status_code == 200
    assert {records(gateway, rid)[0]["server"] for rid in rids} == {name(b)}
    assert all(records(gateway, rid)[0]["policy_version"] == 3 for rid in rids)
    # once a has it too, new rollouts spread again
    redis_client.hset("rlgate:servers:versions", name(a), 3)
    time.sleep(0.6)
    more = [uuid.uuid4().hex for _ in range(6)]
    for rid in more:
        assert call(gateway, rid).status_code == 200
    assert name(a) in {records(gateway, rid)[0]["server"] for rid in more}
    # nobody has version 4 yet: 503 no_upstream, recorded
    redis_client.hset("rlgate:policy", "version", 4)
    time.sleep(0.6)
    rid = uuid.uuid4().hex
    answer = call(gateway, rid)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_upstream"
    assert records(gateway, rid)[0]["error"]["status"] == 503
