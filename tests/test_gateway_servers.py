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
        tmp_path,
        a.url,
        upstream_urls=json.dumps([a.url, b.url]),
        upstream_health_interval_s="1.0",
        policy_poll_s="0.1",
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
    time.sleep(2.5)  # the health loop reads the versions again (every second here)
    more = [uuid.uuid4().hex for _ in range(6)]
    for rid in more:
        assert call(gateway, rid).status_code == 200
    assert name(a) in {records(gateway, rid)[0]["server"] for rid in more}
    # nobody reports version 4 (a learner pushing elsewhere, a record of an earlier run): every healthy
    # server is taken rather than none, and the gateway says so once
    redis_client.hset("rlgate:policy", "version", 4)
    time.sleep(0.6)
    assert call(gateway, uuid.uuid4().hex).status_code == 200
    assert "upstream_versions_behind" in gateway.log()
    # no server up at all: 503 no_upstream with Retry-After, recorded
    a.kill(signal.SIGKILL)
    b.kill(signal.SIGKILL)
    time.sleep(1.0)  # the health loop
    rid = uuid.uuid4().hex
    answer = call(gateway, rid)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_upstream", answer.text
    assert answer.headers["retry-after"] == "1"
    assert records(gateway, rid)[0]["error"]["status"] == 503


def test_servers_are_named_alike_by_the_gateway_and_the_learner():
    from rlgate.episodes import server_name

    assert (
        server_name("http://127.0.0.1:8000/v1/")
        == server_name("http://127.0.0.1:8000")
        == "http://127.0.0.1:8000"
    )
    assert server_name("HTTP://User:secret@GPU0:8000/v1") == "http://gpu0:8000"  # no credentials kept


def test_a_push_reaching_the_servers_is_followed_without_a_gap(two, redis_client: redis.Redis):
    """The learner records each server's version, then moves the pointer: the gateway, whose versions
    were read before, reads them again rather than refusing the calls."""
    gateway, a, b = two
    redis_client.hset("rlgate:servers:versions", mapping={name(a): 1, name(b): 1})
    redis_client.hset("rlgate:policy", mapping={"version": 1, "adapter": "", "base_model": "", "draining": 0})
    time.sleep(0.6)
    for version in (2, 3, 4):
        redis_client.hset("rlgate:servers:versions", mapping={name(a): version, name(b): version})
        redis_client.hset("rlgate:policy", "version", version)
        time.sleep(0.25)  # the policy poll (0.2 s here), less than the health loop's round
        for _ in range(3):
            answer = call(gateway, uuid.uuid4().hex)
            assert answer.status_code == 200, answer.text
    assert "upstream_versions_behind" not in gateway.log()


def test_a_proxy_the_upstream_client_does_not_use_is_said_at_start(
    tmp_path, fake_vllm: Proc, monkeypatch: pytest.MonkeyPatch
):
    """The gateway's own HTTP client connects to its inference servers directly: an HTTP_PROXY that would
    apply to one is named in a warning at start (it was ignored silently), and calls still go straight
    there; with the host in NO_PROXY nothing is said."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: a proxied call would fail
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    for no_proxy, warned in ((None, True), ("127.0.0.1", False)):
        if no_proxy:
            monkeypatch.setenv("NO_PROXY", no_proxy)
        (tmp_path / str(warned)).mkdir()
        gateway = start_gateway(tmp_path / str(warned), fake_vllm.url)
        try:
            with httpx.Client(trust_env=False, timeout=30) as client:
                answer = client.post(
                    f"{gateway.url}/rollouts/{uuid.uuid4().hex}/v1/chat/completions",
                    json={
                        "model": "fake-model",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                    },
                )
            assert answer.status_code == 200, answer.text
            lines = [line for line in gateway.log().splitlines() if "upstream_proxy_not_used" in line]
            assert bool(lines) == warned, gateway.log()[-2000:]
            if warned:
                assert "HTTP_PROXY" in lines[0] and "NO_PROXY" in lines[0] and "127.0.0.1:9" not in lines[0]
        finally:
            gateway.kill(signal.SIGTERM)
