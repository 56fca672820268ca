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
