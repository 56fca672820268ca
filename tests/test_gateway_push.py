"""The gateway during a full-weight push: while the policy pointer says `draining`, new calls wait for the
push to end (and are tagged with the new version) or get 429 with Retry-After, as configured."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import httpx
import redis
from conftest import Proc, start_gateway

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_calls_wait_for_a_push_and_carry_the_new_version(
    fake_vllm: Proc, redis_client: redis.Redis, tmp_path
):
    gateway = start_gateway(tmp_path, fake_vllm.url, policy_poll_s="0.05")
    try:
        redis_client.hset("rlgate:policy", mapping={"version": 2, "draining": 1})
        time.sleep(0.3)
        rid = uuid.uuid4().hex
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=BODY, timeout=30)
            )
        )
        thread.start()
        time.sleep(0.6)
        assert not answers  # held while the push is under way
        redis_client.hset("rlgate:policy", mapping={"version": 3, "draining": 0})
        thread.join(timeout=10)
        assert answers and answers[0].status_code == 200
        [call] = httpx.get(f"{gateway.url}/rollouts/{rid}").json()["calls"]
        assert call["policy_version"] == 3
    finally:
        gateway.kill(signal.SIGTERM)


def test_reject_mode_answers_429_with_retry_after(fake_vllm: Proc, redis_client: redis.Redis, tmp_path):
    gateway = start_gateway(tmp_path, fake_vllm.url, policy_poll_s="0.05", on_push="reject")
    try:
        redis_client.hset("rlgate:policy", mapping={"version": 2, "draining": 1})
        time.sleep(0.3)
        rid = uuid.uuid4().hex
        answer = httpx.post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=BODY, timeout=30)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "policy_push_in_progress"
        assert httpx.get(f"{gateway.url}/rollouts/{rid}").status_code == 404  # nothing recorded
        redis_client.hset("rlgate:policy", mapping={"draining": 0})
        time.sleep(0.3)
        assert (
            httpx.post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=BODY, timeout=30).status_code
            == 200
        )
    finally:
        gateway.kill(signal.SIGTERM)


def test_an_adapter_the_server_lost_is_a_503_to_retry_not_a_404(
    fake_vllm: Proc, redis_client: redis.Redis, tmp_path
):
    """The pointer names an adapter the server does not serve (it restarted; the learner loads it again
    within seconds): the agent, which named the base model, gets 503 with Retry-After (its SDK retries),
    not a 404 for a model it never asked for; the call is recorded as that 503. A model the agent named
    itself that the server lacks stays the server's 404."""
    gateway = start_gateway(tmp_path, fake_vllm.url, policy_poll_s="0.05")
    try:
        redis_client.hset(
            "rlgate:policy", mapping={"version": 7, "adapter": "policy-v7", "base_model": "fake-model"}
        )
        time.sleep(0.3)
        rid = uuid.uuid4().hex
        for stream in (False, True):
            answer = httpx.post(
                f"{gateway.url}/rollouts/{rid}/v1/chat/completions",
                json={**BODY, "stream": stream},
                timeout=30,
            )
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
            error = answer.json()["error"]
            assert error["code"] == "policy_not_loaded" and "policy-v7" in error["message"]
        calls = httpx.get(f"{gateway.url}/rollouts/{rid}").json()["calls"]
        assert [c["error"]["status"] for c in calls] == [503, 503]
        assert [c["error"]["code"] for c in calls] == ["policy_not_loaded"] * 2
        other = httpx.post(
            f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json={**BODY, "model": "other"}, timeout=30
        )
        assert other.status_code == 404
    finally:
        redis_client.hset("rlgate:policy", mapping={"version": 0, "adapter": "", "base_model": ""})
        gateway.kill(signal.SIGTERM)
