"""What the gateway learns from Redis in the background (`gateway.watch`), with real processes: the
backlog holds new rollouts back, Redis losing its data is noticed (and lost rollouts are not reopened),
the policy pointer never goes back, and `/healthz` says when Redis refuses writes."""

from __future__ import annotations

import shutil
import threading
import time
import uuid

import httpx
import pytest
import redis
from conftest import REDIS_BASE, REDIS_DB, Proc, free_port, start_gateway
from redis_servers import private_redis
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL

QUEUE = "backlog-test-rewards"


def chat(gateway: Proc, rid: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/tasks/t/rollouts/{rid}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
        timeout=timeout,
    )


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def health(gateway: Proc) -> dict:
    return httpx.get(f"{gateway.url}/healthz", timeout=10).json()


@pytest.fixture
def backlog_gateway(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(
        tmp_path, fake_vllm.url, max_backlog="3", backlog_wait_s="2", policy_poll_s="0.05", reward_queue=QUEUE
    )
    yield proc
    proc.kill()


def test_new_rollouts_are_held_back_while_episodes_wait_for_training(
    backlog_gateway: Proc, redis_client: redis.Redis
):
    gateway = backlog_gateway
    redis_client.xgroup_create("rlgate:episodes", "learners", id="0", mkstream=True)
    under_way = uuid.uuid4().hex
    assert chat(gateway, under_way).status_code == 200  # an episode under way before the backlog builds
    for _ in range(4):  # four closed episodes nobody trains yet: over the bound of 3
        rid = uuid.uuid4().hex
        assert chat(gateway, rid).status_code == 200
        assert httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": 1.0}).status_code == 200
    wait_for(lambda: health(gateway)["holding_new_rollouts"])
    assert health(gateway)["backlog"] == 4

    new = uuid.uuid4().hex
    t0 = time.monotonic()
    response = chat(gateway, new)
    error = assert_openai_error(response, 429)
    assert error["code"] == "backlog_full" and int(response.headers["retry-after"]) >= 1
    assert time.monotonic() - t0 >= 1.9  # held for backlog_wait_s first
    assert not redis_client.exists(f"rlgate:rollout:{{{new}}}")  # nothing recorded, upstream not called
    created = httpx.post(f"{gateway.url}/rollouts", json={"task_id": "t"})
    assert assert_openai_error(created, 429)["code"] == "backlog_full"
    assert chat(gateway, under_way).status_code == 200  # a rollout under way is never held

    # a new rollout's call held while the learner catches up goes through once it has
    def learner_catches_up() -> None:
        time.sleep(0.2)
        client = redis.Redis(connection_pool=redis_client.connection_pool)
        for _, entries in client.xreadgroup("learners", "l0", {"rlgate:episodes": ">"}, count=10):
            for entry_id, _ in entries:
                client.xack("rlgate:episodes", "learners", entry_id)

    helper = threading.Thread(target=learner_catches_up)
    helper.start()
    late = uuid.uuid4().hex
    response = httpx.post(
        f"{gateway.url}/tasks/t/rollouts/{late}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
        timeout=30,
    )
    helper.join()
    assert response.status_code == 200, response.text
    assert not health(gateway)["holding_new_rollouts"]


def test_a_held_call_with_a_large_body_is_not_cut_off_by_the_body_deadline(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    """Held for the backlog before its body is read, a call's body waits in the server (reading paused
    past 64 KiB): the body deadline is the client's, so it must not run out meanwhile."""
    gateway = start_gateway(
        tmp_path,
        fake_vllm.url,
        max_backlog="1",
        backlog_wait_s="20",
        body_timeout_s="1",
        policy_poll_s="0.05",
        reward_queue=QUEUE,
    )
    try:
        redis_client.rpush(f"rq:queue:{QUEUE}", "a", "b")  # two reward jobs wait: over the bound of 1
        wait_for(lambda: health(gateway)["holding_new_rollouts"])

        def released() -> None:
            time.sleep(2.5)  # more than the body deadline
            redis_client.delete(f"rq:queue:{QUEUE}")

        helper = threading.Thread(target=released)
        helper.start()
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "pad": "x" * (512 * 1024)}
        response = httpx.post(
            f"{gateway.url}/tasks/t/rollouts/{uuid.uuid4().hex}/v1/chat/completions", json=body, timeout=30
        )
        helper.join()
        assert response.status_code == 200, response.text
    finally:
        gateway.kill()


def test_reward_jobs_waiting_in_the_queue_count_toward_the_backlog(
    backlog_gateway: Proc, redis_client: redis.Redis
):
    """No reward worker runs: the /finish jobs pile up in the rq queue and hold new rollouts back."""
    _reward_jobs_hold_new_rollouts(backlog_gateway, redis_client)


def test_reward_jobs_in_a_queue_redis_of_their_own_count_too(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    """RLGATE_QUEUE_REDIS_URL (a cluster's deployments need it): the jobs wait there, and count from there."""
    queue_db = redis.Redis.from_url(f"{REDIS_BASE}/{REDIS_DB + 1}")
    queue_db.delete(f"rq:queue:{QUEUE}")
    gateway = start_gateway(
        tmp_path,
        fake_vllm.url,
        max_backlog="3",
        backlog_wait_s="2",
        policy_poll_s="0.05",
        reward_queue=QUEUE,
        queue_redis_url=f"{REDIS_BASE}/{REDIS_DB + 1}",
    )
    try:
        _reward_jobs_hold_new_rollouts(gateway, queue_db)
        assert redis_client.llen(f"rq:queue:{QUEUE}") == 0  # none in the episodes' Redis
    finally:
        gateway.kill()
        for key in queue_db.scan_iter(match="rq:*"):
            queue_db.delete(key)
        queue_db.close()


def _reward_jobs_hold_new_rollouts(gateway: Proc, queue: redis.Redis) -> None:
    for _ in range(4):
        rid = uuid.uuid4().hex
        assert chat(gateway, rid).status_code == 200
        finish = httpx.post(
            f"{gateway.url}/rollouts/{rid}/finish", json={"reward_fn": "exact_match", "ground_truth": "x"}
        )
        assert finish.status_code == 202, finish.text
    assert queue.llen(f"rq:queue:{QUEUE}") == 4
    wait_for(lambda: health(gateway)["holding_new_rollouts"])
    assert assert_openai_error(chat(gateway, uuid.uuid4().hex), 429)["code"] == "backlog_full"
    queue.delete(f"rq:queue:{QUEUE}")  # the worker took them
    wait_for(lambda: not health(gateway)["holding_new_rollouts"])
    assert chat(gateway, uuid.uuid4().hex).status_code == 200


def test_redis_losing_its_data_is_noticed_and_lost_rollouts_are_not_reopened(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    gateway = start_gateway(tmp_path, fake_vllm.url, policy_poll_s="0.05")
    try:
        redis_client.hset(
            "rlgate:policy", mapping={"version": "3", "adapter": "", "base_model": MODEL, "draining": "0"}
        )
        wait_for(lambda: health(gateway)["policy_version"] == 3)
        closed, open_ = uuid.uuid4().hex, uuid.uuid4().hex
        assert chat(gateway, closed).status_code == 200 and chat(gateway, open_).status_code == 200
        assert httpx.post(f"{gateway.url}/rollouts/{closed}/reward", json={"reward": 1.0}).status_code == 200
        assert health(gateway)["status"] == "ok"

        redis_client.flushdb()  # Redis restarted without its data
        wait_for(lambda: health(gateway)["status"] == "degraded")
        state = health(gateway)
        assert set(state["problems"]) == {"store", "policy_pointer"}
        assert state["policy_version"] == 3  # the pointer is kept, never silently back to version 0
        for rid in (closed, open_):  # neither reopens: the closed one cannot be closed again
            assert assert_openai_error(chat(gateway, rid), 409)["code"] == "rollout_data_lost"
            assert not redis_client.exists(f"rlgate:rollout:{{{rid}}}")
        again = httpx.post(f"{gateway.url}/rollouts/{closed}/reward", json={"reward": 0.0})
        assert again.status_code == 404
        created = httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": closed})
        assert assert_openai_error(created, 409)["code"] == "rollout_data_lost"
        fresh = uuid.uuid4().hex
        response = chat(gateway, fresh)  # new rollouts go on, tagged with the kept version
        assert response.status_code == 200
        assert httpx.get(f"{gateway.url}/rollouts/{fresh}").json()["calls"][0]["policy_version"] == 3
        metrics = httpx.get(f"{gateway.url}/metrics").text
        assert 'rlgate_gateway_errors_total{kind="store_data_lost"} 1.0' in metrics

        # the learner re-pushes its version: the pointer problem clears, the data loss stays reported
        redis_client.hset(
            "rlgate:policy", mapping={"version": "3", "adapter": "", "base_model": MODEL, "draining": "0"}
        )
        wait_for(lambda: "policy_pointer" not in health(gateway)["problems"])
        assert health(gateway)["status"] == "degraded"
    finally:
        gateway.kill()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server for a private Redis")
def test_healthz_reports_a_redis_that_refuses_writes(fake_vllm: Proc, tmp_path):
    port = free_port()
    with private_redis(port) as client:
        gateway = start_gateway(tmp_path, fake_vllm.url, redis_url=f"redis://127.0.0.1:{port}/0")
        try:
            assert health(gateway)["status"] == "ok"
            rid = uuid.uuid4().hex
            assert chat(gateway, rid).status_code == 200
            client.config_set("maxmemory", "1")  # noeviction: every write is refused, reads still work
            response = httpx.get(f"{gateway.url}/healthz", timeout=10)
            assert response.status_code == 503 and "maxmemory" in response.json()["redis"]
            # (a new rollout would be held back for Redis's memory: one under way is refused)
            error = assert_openai_error(chat(gateway, rid), 503)
            assert error["code"] == "store_unavailable"
            client.config_set("maxmemory", "0")
            assert httpx.get(f"{gateway.url}/healthz", timeout=10).status_code == 200
        finally:
            gateway.kill()


def test_new_rollouts_are_held_back_while_redis_is_nearly_full(fake_vllm: Proc, tmp_path):
    """Redis refusing writes at maxmemory fails every call, those of rollouts under way too. Above
    redis_memory_high of maxmemory the gateway holds new rollouts back first (429 redis_memory_high with
    Retry-After, after backlog_wait_s), while rollouts under way go on; when memory is free again, new
    rollouts start."""
    port = free_port()
    with private_redis(port) as client:
        gateway = start_gateway(
            tmp_path,
            fake_vllm.url,
            redis_url=f"redis://127.0.0.1:{port}/0",
            redis_memory_high="0.5",
            backlog_wait_s="1",
            policy_poll_s="0.05",
        )
        try:
            under_way = uuid.uuid4().hex
            assert chat(gateway, under_way).status_code == 200
            assert health(gateway)["redis_memory"]["max"] == 0  # none set: never held for memory
            client.config_set("maxmemory", str(64 << 20))
            client.mset({f"junk{i}": b"x" * (1 << 20) for i in range(40)})  # 40 of 64 MiB: over half
            wait_for(lambda: health(gateway)["holding_new_rollouts"])
            state = health(gateway)
            assert state["redis_memory"]["max"] == 64 << 20 and state["redis_memory"]["used"] > 40 << 20
            refused = chat(gateway, uuid.uuid4().hex)
            error = assert_openai_error(refused, 429)
            assert error["code"] == "redis_memory_high" and "maxmemory" in error["message"]
            assert int(refused.headers["retry-after"]) >= 1
            created = httpx.post(f"{gateway.url}/rollouts", json={"task_id": "t"}, timeout=10)
            assert assert_openai_error(created, 429)["code"] == "redis_memory_high"
            assert chat(gateway, under_way).status_code == 200  # a rollout under way goes on
            client.delete(*(f"junk{i}" for i in range(40)))
            wait_for(lambda: not health(gateway)["holding_new_rollouts"])
            assert chat(gateway, uuid.uuid4().hex).status_code == 200
        finally:
            gateway.kill()
