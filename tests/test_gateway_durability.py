"""No success without a record: Redis trouble gives 503, a killed gateway loses no answered call, and
several gateway processes share one store."""

from __future__ import annotations

import concurrent.futures
import shutil
import signal
import subprocess
import time
import uuid

import httpx
import openai
import pytest
from conftest import Proc, free_port, start_fake_vllm, start_gateway
from redis_servers import redis_server_command
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL, rollout


def start_gateway_without_redis(tmp_path, upstream: Proc, **settings: str) -> Proc:
    """A gateway whose Redis URL names a port nothing listens on (not waited for: it is never healthy)."""
    return start_gateway(
        tmp_path,
        upstream.url,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        wait_healthy=False,
        redis_timeout_s="0.5",
        **settings,
    )


def test_dead_redis_is_503_never_an_unrecorded_success(fake_vllm: Proc, tmp_path):
    proc = start_gateway_without_redis(tmp_path, fake_vllm)
    try:
        assert httpx.get(f"{proc.url}/healthz").status_code == 503
        url = f"{proc.url}/rollouts/r1/v1/chat/completions"
        response = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
        error = assert_openai_error(response, 503)
        assert error["code"] == "store_unavailable" and response.headers["retry-after"] == "1"
        # a stream that cannot be recorded ends in an error event, never in [DONE]
        with httpx.stream("POST", url, json={"model": MODEL, "messages": MESSAGES, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert "data: [DONE]" not in lines and '"service_unavailable_error"' in lines[-1]
        client = openai.OpenAI(base_url=f"{proc.url}/rollouts/r1/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError):
            list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    finally:
        proc.kill()


def test_pass_mode_serves_unrecorded_calls_and_says_so(fake_vllm: Proc, tmp_path):
    proc = start_gateway_without_redis(tmp_path, fake_vllm, on_store_error="pass")
    try:
        response = httpx.post(
            f"{proc.url}/rollouts/r1/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
        )
        assert response.status_code == 200
    finally:
        proc.kill()
    assert '"event":"call_not_recorded"' in proc.log()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_redis_dying_under_a_running_gateway(fake_vllm: Proc, tmp_path):
    port = free_port()
    server = subprocess.Popen(redis_server_command(port), stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    proc = start_gateway(
        tmp_path, fake_vllm.url, redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s="0.5"
    )
    try:
        url = f"{proc.url}/rollouts/r1/v1/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        assert httpx.post(url, json=body).status_code == 200
        server.kill()
        server.wait()
        assert_openai_error(httpx.post(url, json=body), 503)
        # Redis comes back (empty: no persistence here): the gateway reconnects, notices the loss (its epoch
        # marker is gone) and records again, but never reopens the rollout whose data was lost
        server = subprocess.Popen(redis_server_command(port), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while _health(proc).get("status") != "degraded":
            assert time.monotonic() < deadline, _health(proc)
            time.sleep(0.05)
        assert assert_openai_error(httpx.post(url, json=body), 409)["code"] == "rollout_data_lost"
        url = f"{proc.url}/rollouts/r2/v1/chat/completions"
        # a connection that died with the old Redis may cost the first call a 503 (it is not recorded)
        answers = [httpx.post(url, json=body).status_code for _ in range(2)]
        assert answers in ([200, 200], [503, 200]), answers
        stored = rollout(proc, "r2")
        assert len(stored["calls"]) == answers.count(200) and stored["calls"][0]["completion_token_ids"]
        metrics = httpx.get(f"{proc.url}/metrics").text
        assert "rlgate_gateway_record_connects_total 2.0" in metrics  # one connection per Redis life
        if answers == [200, 200]:
            # per Redis life: EVALSHA (NOSCRIPT: a new Redis has no scripts), SCRIPT LOAD, EVALSHA; then
            # r2's second call: EVALSHA
            assert "rlgate_gateway_record_commands_total 7.0" in metrics
        assert "rlgate_gateway_record_in_flight 0.0" in metrics
    finally:
        proc.kill()
        if server.poll() is None:
            server.kill()


def _health(proc: Proc) -> dict:
    try:
        return httpx.get(f"{proc.url}/healthz", timeout=5).json()
    except httpx.TransportError:
        return {}


def test_upstream_restart_under_a_running_gateway(tmp_path, redis_client):
    """The upstream goes away and comes back on the same port: the gateway's pooled connections to the old
    process are dropped, calls in between get 502, and later calls are served and recorded."""
    upstream = start_fake_vllm(tmp_path)
    port = int(upstream.url.split(":")[2].split("/")[0])
    proc = start_gateway(tmp_path, upstream.url)
    try:
        url = f"{proc.url}/rollouts/restart/v1/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:  # several pooled connections
            assert {r.status_code for r in pool.map(lambda _: httpx.post(url, json=body), range(16))} == {200}
        upstream.kill(signal.SIGKILL)
        assert_openai_error(httpx.post(url, json=body), 502)
        upstream = start_fake_vllm(tmp_path, port=port)
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            assert {r.status_code for r in pool.map(lambda _: httpx.post(url, json=body), range(16))} == {200}
        metrics = httpx.get(f"{proc.url}/metrics").text
        opened = float(metrics.split('rlgate_gateway_upstream_connections{state="open"} ')[1].split()[0])
        idle = float(metrics.split('rlgate_gateway_upstream_connections{state="idle"} ')[1].split()[0])
        assert 1 <= idle <= opened <= 8  # the new process's connections only, back in the pool
        calls = rollout(proc, "restart")["calls"]
        assert len(calls) == 33
        assert sum(call["error"] is None for call in calls) == 32
    finally:
        proc.kill()
        upstream.kill()


def test_sigkill_loses_no_answered_call(tmp_path, redis_client):
    slow = start_fake_vllm(tmp_path, "--delay-ms", "40", "--chunk-delay-ms", "5")
    port = free_port()
    proc = start_gateway(tmp_path, slow.url, port=port)
    answered: list[tuple[str, str]] = []  # (rollout id, upstream response id) of every call that succeeded

    def one_call(i: int) -> tuple[str, str] | None:
        rid = f"kill-{i}-{uuid.uuid4().hex[:8]}"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": i % 2 == 1}
        try:
            with httpx.stream(
                "POST", f"{proc.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=10
            ) as response:
                if response.status_code != 200:
                    return None
                data = list(response.iter_lines())
        except httpx.HTTPError:
            return None
        if body["stream"]:
            if "data: [DONE]" not in data:
                return None
            return rid, httpx.Response(200, content=data[0][6:]).json()["id"]
        return rid, httpx.Response(200, content="\n".join(data)).json()["id"]

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=48) as pool:
            futures = [pool.submit(one_call, i) for i in range(400)]
            time.sleep(1.0)
            proc.kill(signal.SIGKILL)
            results = [f.result() for f in futures]
        answered = [r for r in results if r is not None]
        failed = len(results) - len(answered)
        assert answered and failed, f"the kill must land mid-run: {len(answered)} answered, {failed} failed"
        proc = start_gateway(tmp_path, slow.url, port=port)  # restarted, same store
        for rid, response_id in answered:
            calls = rollout(proc, rid)["calls"]
            assert [c["response"]["id"] for c in calls] == [response_id]
    finally:
        proc.kill()
        slow.kill()


def test_two_gateways_share_one_store(gateway: Proc, fake_vllm: Proc, tmp_path, redis_client):
    other = start_gateway(tmp_path, fake_vllm.url)
    try:
        rid = uuid.uuid4().hex
        urls = [f"{g.url}/tasks/t-shared/rollouts/{rid}/v1/chat/completions" for g in (gateway, other)]

        def call(i: int) -> int:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "seed": i, "stream": i % 3 == 0}
            with httpx.stream("POST", urls[i % 2], json=body, timeout=30) as response:
                response.read()
                return response.status_code

        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            statuses = list(pool.map(call, range(60)))
        assert statuses == [200] * 60
        calls = rollout(other, rid)["calls"]
        assert [c["index"] for c in calls] == list(range(60))
        assert sorted(c["request"]["seed"] for c in calls) == list(range(60))
        assert rollout(gateway, rid) == rollout(other, rid)
        # one agent whose calls alternate between the two: recorded in its order, one index each
        turns = uuid.uuid4().hex
        for i in range(10):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "seed": i, "stream": i % 4 == 1}
            url = f"{(gateway, other)[i % 2].url}/rollouts/{turns}/v1/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=30) as response:
                response.read()
                assert response.status_code == 200
        calls = rollout(gateway, turns)["calls"]
        assert [(c["index"], c["request"]["seed"]) for c in calls] == [(i, i) for i in range(10)]
        # both follow the one policy pointer: a push seen by each, their next calls tagged with it
        redis_client.hset("rlgate:policy", "version", 4)
        try:
            for g in (gateway, other):
                wait_for_policy_version(g, 4)
                assert (
                    httpx.post(f"{g.url}/rollouts/{turns}/v1/chat/completions", json=body).status_code == 200
                )
        finally:
            redis_client.hset("rlgate:policy", "version", 0)
            for g in (gateway, other):
                wait_for_policy_version(g, 0)
        assert [c["policy_version"] for c in rollout(other, turns)["calls"]] == [0] * 10 + [4, 4]
    finally:
        other.kill()


def test_policy_version_tags_later_calls(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    url = f"{gateway.url}/rollouts/{rid}/v1/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    assert httpx.post(url, json=body).status_code == 200
    redis_client.hset("rlgate:policy", "version", 3)
    try:
        wait_for_policy_version(gateway, 3)
        assert httpx.post(url, json=body).status_code == 200
    finally:  # a pointer that disappears is kept (Redis lost it); a learner starting afresh writes 0
        redis_client.hset("rlgate:policy", "version", 0)
        wait_for_policy_version(gateway, 0)
    assert [c["policy_version"] for c in rollout(gateway, rid)["calls"]] == [0, 3]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'rlgate_gateway_calls_total{endpoint="chat.completions",outcome="ok"}' in metrics
    assert "rlgate_gateway_store_latency_seconds_bucket" in metrics


def wait_for_policy_version(gateway: Proc, version: int) -> None:
    deadline = time.monotonic() + 5
    while httpx.get(f"{gateway.url}/healthz").json()["policy_version"] != version:
        assert time.monotonic() < deadline, "the gateway did not pick up the policy version"
        time.sleep(0.05)
