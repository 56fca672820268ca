"""The reward routes as an attacker meets them, through real gateway processes, a real Redis and real rq
workers: signed requests replayed elsewhere or too late, the documented curl/openssl signer, rewards out
of range, `/fail`, and reward jobs that try to stall or poison the worker."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from conftest import REDIS_URL, ROOT, Proc, start_gateway
from rq import Queue
from rq.serializers import JSONSerializer
from test_gateway_errors import assert_openai_error, refusals
from test_gateway_proxy import rollout
from test_reward_hooks import SECRET, agent_call, redis_snapshot, run_worker, stream_entries

from reward_hooks import signing
from rlgate.episodes import CallRecord, CallResponse, ClosedEpisodes, EpisodeStore

TOLERANCE_S = 300  # large: a binding check must fail on the binding, not on a slow machine's clock


@pytest.fixture
def signed_gateway(fake_vllm: Proc, tmp_path: Path) -> Proc:
    proc = start_gateway(tmp_path, fake_vllm.url, webhook_secret=SECRET, webhook_tolerance_s=str(TOLERANCE_S))
    yield proc
    proc.kill()


def sign(path: str, body: bytes, **kw) -> dict[str, str]:
    return signing.sign(SECRET, "POST", path, body, **kw)


def post(gateway: Proc, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        gateway.url + path, content=body, headers={"content-type": "application/json", **headers}
    )


def test_a_captured_signed_reward_is_refused_anywhere_else_and_later(signed_gateway: Proc, redis_client):
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    agent_call(signed_gateway, a)
    agent_call(signed_gateway, b)
    body = b'{"reward": 1.0}'
    captured = signing.sign(SECRET, "POST", f"/rollouts/{a}/reward", body)  # on its way to rollout a
    before = redis_snapshot(redis_client)
    for path in (
        f"/rollouts/{b}/reward",
        f"/rollouts/{a}/calls/0/reward",
        f"/rollouts/{b}/calls/0/reward",
        f"/rollouts/{a}/fail",
        f"/rollouts/{a}/finish",
        f"/rollouts/{a}//reward",
    ):
        refused = post(signed_gateway, path, body, captured)
        assert refused.status_code in (401, 404), path  # 404: a path no route has
        if refused.status_code == 401:
            assert assert_openai_error(refused, 401)["code"] == "invalid_signature", path
    with_query = post(signed_gateway, f"/rollouts/{a}/reward?again=1", body, captured)  # unsigned: refused
    assert assert_openai_error(with_query, 400)["code"] == "query_not_allowed"
    assert redis_snapshot(redis_client) == before

    # the same request, on its own route, once the window has passed: signed that long ago
    late = sign(f"/rollouts/{a}/reward", body, timestamp=int(time.time()) - TOLERANCE_S - 60)
    assert (
        assert_openai_error(post(signed_gateway, f"/rollouts/{a}/reward", body, late), 401)["code"]
        == "signature_expired"
    )
    assert redis_snapshot(redis_client) == before
    assert rollout(signed_gateway, a)["status"] == rollout(signed_gateway, b)["status"] == "open"

    # signed now, it is accepted: the signature was what refused it
    fresh = post(
        signed_gateway,
        f"/rollouts/{a}/reward",
        body,
        signing.sign(SECRET, "POST", f"/rollouts/{a}/reward", body),
    )
    assert fresh.status_code == 200 and fresh.json()["outcome"] == "closed"
    assert stream_entries(redis_client) == [a]


def test_a_signed_call_reward_is_refused_on_another_call_or_rollout(signed_gateway: Proc, redis_client):
    rid, other = uuid.uuid4().hex, uuid.uuid4().hex
    agent_call(signed_gateway, rid)
    agent_call(signed_gateway, rid)
    agent_call(signed_gateway, other)
    body = b'{"reward": 0.5}'
    captured = signing.sign(SECRET, "POST", f"/rollouts/{rid}/calls/1/reward", body)
    before = redis_snapshot(redis_client)
    for path in (
        f"/rollouts/{rid}/calls/0/reward",
        f"/rollouts/{other}/calls/1/reward",
        f"/rollouts/{rid}/reward",
    ):
        assert (
            assert_openai_error(post(signed_gateway, path, body, captured), 401)["code"]
            == "invalid_signature"
        )
    assert redis_snapshot(redis_client) == before
    assert post(signed_gateway, f"/rollouts/{rid}/calls/1/reward", body, captured).status_code == 200
    assert [c["reward"] for c in rollout(signed_gateway, rid)["calls"]] == [None, 0.5]


def test_a_signed_request_is_accepted_once(signed_gateway: Proc, redis_client):
    """Within the tolerance window a captured request is still signed correctly: its webhook-id is what
    refuses it the second time, so it cannot undo a later per-call reward or overwrite /finish."""
    rid = uuid.uuid4().hex
    agent_call(signed_gateway, rid)
    path = f"/rollouts/{rid}/calls/0/reward"
    first = sign(path, b'{"reward": 0.5}')
    assert post(signed_gateway, path, b'{"reward": 0.5}', first).status_code == 200
    assert post(signed_gateway, path, b'{"reward": 0.25}', sign(path, b'{"reward": 0.25}')).status_code == 200
    before = redis_snapshot(redis_client)
    replayed = post(signed_gateway, path, b'{"reward": 0.5}', first)  # would set 0.5 again over 0.25
    assert assert_openai_error(replayed, 409)["code"] == "webhook_replayed"
    assert redis_snapshot(redis_client) == before
    assert [c["reward"] for c in rollout(signed_gateway, rid)["calls"]] == [0.25]
    ttl = redis_client.ttl(f"rlgate:webhook:{first[signing.ID_HEADER]}")
    assert 2 * TOLERANCE_S - 60 < ttl <= 2 * TOLERANCE_S  # as long as its timestamp could be accepted

    finish_path, finish_body = f"/rollouts/{rid}/finish", b'{"reward_fn": "f1", "ground_truth": "a"}'
    finished = sign(finish_path, finish_body)
    # the queue is configured by the gateway; 202 or 503 (no worker queue), either way the id is spent
    assert post(signed_gateway, finish_path, finish_body, finished).status_code in (202, 503)
    before = redis_snapshot(redis_client)
    again = post(signed_gateway, finish_path, finish_body, finished)
    assert assert_openai_error(again, 409)["code"] == "webhook_replayed"
    assert redis_snapshot(redis_client) == before


def test_a_webhook_id_is_spent_only_by_a_valid_signature(signed_gateway: Proc, redis_client):
    """Ids are remembered after the signature holds: a forged request naming the id of one still to come
    spends nothing."""
    rid = uuid.uuid4().hex
    agent_call(signed_gateway, rid)
    path, body = f"/rollouts/{rid}/reward", b'{"reward": 1.0}'
    coming = sign(path, body)
    forged = {
        **coming,
        signing.SIGNATURE_HEADER: signing.signature(
            "not-the-secret-at-all",
            coming[signing.ID_HEADER],
            coming[signing.TIMESTAMP_HEADER],
            "POST",
            path,
            body,
        ),
    }
    before = redis_snapshot(redis_client)
    assert assert_openai_error(post(signed_gateway, path, body, forged), 401)["code"] == "invalid_signature"
    assert redis_snapshot(redis_client) == before
    assert post(signed_gateway, path, body, coming).json()["outcome"] == "closed"


def documented_example() -> str:
    """The bash block that follows `<!-- signed-curl-example -->` in docs/security.md."""
    text = (ROOT / "docs" / "security.md").read_text()
    found = re.search(r"<!-- signed-curl-example -->\n```bash\n(.*?)```", text, re.DOTALL)
    assert found, "docs/security.md lost its signed curl example"
    return found.group(1)


def run_documented_example(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The documented example run by bash under `env`; it must exit 0."""
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", documented_example()],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )


def test_the_documented_curl_and_openssl_example_signs_correctly(signed_gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    agent_call(signed_gateway, rid)
    env = {**os.environ, "GATEWAY": signed_gateway.url, "ROLLOUT": rid, "RLGATE_WEBHOOK_SECRET": SECRET}
    out = run_documented_example(env)
    assert '"outcome":"closed"' in out.stdout, out.stdout + out.stderr
    stored = rollout(signed_gateway, rid)
    assert stored["status"] == "closed" and stored["reward"] == 1.0
    # and with another secret the same script is refused
    env["RLGATE_WEBHOOK_SECRET"] = "another-secret"
    env["ROLLOUT"] = rid2 = uuid.uuid4().hex
    agent_call(signed_gateway, rid2)
    out = run_documented_example(env)
    assert '"code":"invalid_signature"' in out.stdout and rollout(signed_gateway, rid2)["status"] == "open"


def test_fail_closes_an_open_rollout_once_and_never_publishes_it(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    url = f"{gateway.url}/rollouts/{rid}/fail"
    refusals(
        url,
        (b'{"reason": ""}', b'{"reason": 5}', b'{"why": "x"}', b"[1]", b'{"reason": "' + b"x" * 2001 + b'"}'),
        422,
    )
    assert rollout(gateway, rid)["status"] == "open"
    answer = httpx.post(url, json={"reason": "the sandbox crashed"})
    assert answer.status_code == 200
    assert answer.json() == {"rollout_id": rid, "status": "failed", "error": "the sandbox crashed"}
    stored = rollout(gateway, rid)
    assert (
        stored["status"] == "failed" and stored["error"] == "the sandbox crashed" and stored["reward"] is None
    )

    before = redis_snapshot(redis_client)
    again = assert_openai_error(httpx.post(url), 409)
    assert again["code"] == "rollout_not_open" and "failed" in again["message"]
    assert_openai_error(httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": 1}), 409)
    assert_openai_error(httpx.post(f"{gateway.url}/rollouts/{rid}/calls/0/reward", json={"reward": 1}), 409)
    assert_openai_error(httpx.post(f"{gateway.url}/rollouts/nobody/fail"), 404)
    assert redis_snapshot(redis_client) == before

    closed = uuid.uuid4().hex  # a closed rollout cannot be failed after the fact
    agent_call(gateway, closed)
    httpx.post(f"{gateway.url}/rollouts/{closed}/reward", json={"reward": 0.25})
    assert (
        assert_openai_error(httpx.post(f"{gateway.url}/rollouts/{closed}/fail"), 409)["code"]
        == "rollout_not_open"
    )
    assert rollout(gateway, closed)["status"] == "closed"

    empty = uuid.uuid4().hex  # no body: a default reason
    agent_call(gateway, empty)
    assert httpx.post(f"{gateway.url}/rollouts/{empty}/fail").json()["error"] == "failed by the operator"

    # what a learner reads: the closed episode only
    async def learner_reads() -> list[str]:
        store = EpisodeStore.from_url(REDIS_URL)
        try:
            stream = ClosedEpisodes(store)
            await stream.ensure_group()
            return [e.rollout_id for e in await stream.read("learner-0", count=100, block_ms=100)]
        finally:
            await store.aclose()

    assert asyncio.run(learner_reads()) == [closed]
    assert redis_client.zscore("rlgate:expiry", rid) is None and redis_client.zcard("rlgate:outbox") == 0


def test_a_pending_reward_job_finds_a_failed_rollout_and_leaves_it(
    job_gateway: Proc, redis_client: redis.Redis
):
    rid = uuid.uuid4().hex
    agent_call(job_gateway, rid)
    finish(job_gateway, rid, "stall_rewards:sleeps", runs=[REDIS_URL, "runs"])
    assert (
        httpx.post(f"{job_gateway.url}/rollouts/{rid}/fail", json={"reason": "given up"}).status_code == 200
    )
    run_worker(redis_client, reward_fn_modules='["stall_rewards"]')
    stored = rollout(job_gateway, rid)
    assert (
        stored["status"] == "failed" and stored["error"] == "given up" and stream_entries(redis_client) == []
    )
    assert redis_client.get("runs") is None  # the job saw the rollout was no longer open and did not score it


def test_reward_range_is_a_setting(fake_vllm: Proc, tmp_path: Path, redis_client: redis.Redis):
    proc = start_gateway(tmp_path, fake_vllm.url, max_abs_reward="10")
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        before = redis_snapshot(redis_client)
        for path in (f"/rollouts/{rid}/reward", f"/rollouts/{rid}/calls/0/reward"):
            error = assert_openai_error(httpx.post(proc.url + path, json={"reward": -10.5}), 422)
            assert error["code"] == "reward_out_of_range" and "[-10, 10]" in error["message"]
        assert redis_snapshot(redis_client) == before
        assert (
            httpx.post(f"{proc.url}/rollouts/{rid}/calls/0/reward", json={"reward": -10}).status_code == 200
        )
        assert httpx.post(f"{proc.url}/rollouts/{rid}/reward", json={"reward": 10}).json()["reward"] == 10.0
    finally:
        proc.kill()


# --------------------------------------------------------------------------------------------------------
# Reward jobs: bounded results, a time limit, no retries of what would fail again, the next job still runs


@pytest.fixture
def job_gateway(fake_vllm: Proc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Proc:
    """A gateway (and, through the same variables, in-process workers) that may name `stall_rewards`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    # the gateway enqueues, so the job's time limit and retries are its settings (rq keeps them in the job)
    proc = start_gateway(
        tmp_path,
        fake_vllm.url,
        reward_fn_modules='["stall_rewards"]',
        reward_job_retries="3",
        reward_job_backoff_s="[0]",
        reward_job_timeout_s="1",
    )
    yield proc
    proc.kill()


def finish(gateway: Proc, rid: str, reward_fn: str, ground_truth=None, **params) -> None:
    answer = httpx.post(
        f"{gateway.url}/rollouts/{rid}/finish",
        json={"reward_fn": reward_fn, "ground_truth": ground_truth, "params": params},
    )
    assert answer.status_code == 202, answer.text


def test_bad_results_and_timeouts_fail_the_episode_at_once(job_gateway: Proc, redis_client: redis.Redis):
    jobs = {
        "huge": "stall_rewards:huge",
        "nan": "stall_rewards:not_a_number",
        "none": "stall_rewards:nothing",
        "slow": "stall_rewards:sleeps",
    }
    rids = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in [*jobs, "fine"]}
    for name, fn in jobs.items():
        agent_call(job_gateway, rids[name])
        finish(job_gateway, rids[name], fn, seconds=30, runs=[REDIS_URL, f"runs:{name}"])
    agent_call(job_gateway, rids["fine"])
    finish(job_gateway, rids["fine"], "f1", "zzz")  # queued behind all of them

    started = time.monotonic()
    run_worker(
        redis_client, reward_fn_modules='["stall_rewards"]'
    )  # retried, the timeout alone would take 4 s
    elapsed = time.monotonic() - started

    errors = {name: rollout(job_gateway, rids[name]) for name in jobs}
    assert all(stored["status"] == "failed" for stored in errors.values())
    assert errors["huge"]["error"] == (
        "RewardOutOfRange: the result of reward function 'stall_rewards:huge' must "
        "lie in [-1e+06, 1e+06] (max_abs_reward), got 1e+308"
    )
    assert "must be a finite number, got nan" in errors["nan"]["error"]
    assert "must be a number, got NoneType" in errors["none"]["error"]
    assert (
        errors["slow"]["error"].startswith("JobTimeoutException") and "1 seconds" in errors["slow"]["error"]
    )
    fine = rollout(job_gateway, rids["fine"])
    assert fine["status"] == "closed" and fine["reward"] == 0.0
    assert stream_entries(redis_client) == [rids["fine"]]
    queue = Queue("rlgate-rewards", connection=redis_client, serializer=JSONSerializer)
    failed = [queue.fetch_job(job_id) for job_id in queue.failed_job_registry.get_job_ids()]
    assert len(failed) == 4
    assert {name: int(redis_client.get(f"runs:{name}")) for name in jobs} == dict.fromkeys(
        jobs, 1
    )  # no retry
    assert elapsed < 60, elapsed  # generous (a loaded machine): the run counts are what show no retry


def test_only_errors_a_retry_may_fix_are_retried(job_gateway: Proc, redis_client: redis.Redis):
    jobs = {
        "input": "stall_rewards:bad_input",
        "network": "stall_rewards:unreachable",
        "numpy": "stall_rewards:numpy_bool",
    }
    rids = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in jobs}
    for name, fn in jobs.items():
        agent_call(job_gateway, rids[name])
        finish(job_gateway, rids[name], fn, runs=[REDIS_URL, f"runs:{name}"])
    run_worker(redis_client, reward_fn_modules='["stall_rewards"]')
    stored = {name: rollout(job_gateway, rid) for name, rid in rids.items()}
    assert stored["input"]["status"] == "failed" and stored["input"]["error"].startswith("RewardInputError")
    assert stored["network"]["status"] == "failed" and stored["network"]["error"].startswith(
        "ConnectionError"
    )
    assert (stored["numpy"]["status"], stored["numpy"]["reward"]) == ("closed", 1.0)
    # three retries for the network error, none for the input a retry cannot change
    assert {name: int(redis_client.get(f"runs:{name}")) for name in jobs} == {
        "input": 1,
        "network": 4,
        "numpy": 1,
    }


def record_answer(rid: str, answer: str) -> None:
    """An episode whose final answer is `answer`, written the way the gateway records a chat call."""
    record = CallRecord(
        rollout_id=rid,
        endpoint="chat.completions",
        policy_version=0,
        started_at=time.time(),
        latency_ms=1.0,
        request={"messages": [{"role": "user", "content": "q"}]},
        response=CallResponse(message={"role": "assistant", "content": answer}),
        prompt_token_ids=[1],
        completion_token_ids=[2],
        completion_logprobs=[-0.5],
    )

    async def go() -> None:
        store = EpisodeStore.from_url(REDIS_URL)
        try:
            await store.record_calls(rid, None, [record])
        finally:
            await store.aclose()

    asyncio.run(go())


SQL_BOMBS = {  # each took 3-38 s and up to 2.8 GB in one query before the limits (timeout_s 5)
    "printf": "SELECT printf('%.*c', 2147483647, 'x') IS NULL",
    "replace": "SELECT length(replace(printf('%.*c', 1000000, 'a'), printf('%.*c', 500000, 'a') || 'b', ''))",
    "zeroblob": "SELECT length(replace(hex(zeroblob(200000000)), '0', 'ab'))",
    "doubling": "WITH RECURSIVE r(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM r WHERE length(s) < 500000000) "
    "SELECT max(length(s)) FROM r",
    "rows": "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 100000) "
    "SELECT printf('%.*c', 20000, 'x') FROM r",
}


def test_pathological_answers_score_zero_quickly_and_the_next_job_runs(
    fake_vllm: Proc, tmp_path: Path, redis_client: redis.Redis
):
    with sqlite3.connect(tmp_path / "db.sqlite") as db:
        db.execute("CREATE TABLE t (x INTEGER)")
        db.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(100)])
    db.close()
    proc = start_gateway(tmp_path, fake_vllm.url)
    try:
        cases = {
            "tags": ("format_and_f1", "<answer>" * 40_960, "paris", {}),  # 320 KB: 118 s before
            "digits": ("math_answer", "1" * 327_680, 3, {}),  # Python refuses such an int: was retried
            "fence": ("sql_execution_match", "```" + " " * 327_680, "SELECT 1", {"db_path": "db.sqlite"}),
            **{
                f"sql-{name}": (
                    "sql_execution_match",
                    query,
                    "SELECT count(*) FROM t",
                    {"db_path": "db.sqlite"},
                )
                for name, query in SQL_BOMBS.items()
            },
        }
        rids = {}
        for name, (fn, answer, truth, params) in cases.items():
            rids[name] = f"{name}-{uuid.uuid4().hex[:8]}"
            record_answer(rids[name], answer)
            finish(proc, rids[name], fn, truth, **params)
        rids["fine"] = f"fine-{uuid.uuid4().hex[:8]}"
        record_answer(rids["fine"], "```sql\nSELECT count(*) FROM t\n```")
        finish(proc, rids["fine"], "sql_execution_match", "SELECT 100", db_path="db.sqlite")

        started = time.monotonic()
        run_worker(redis_client, reward_data_dir=str(tmp_path))
        elapsed = time.monotonic() - started

        scored = {name: rollout(proc, rid) for name, rid in rids.items()}
        assert {name: (s["status"], s["reward"]) for name, s in scored.items()} == {
            **{name: ("closed", 0.0) for name in cases},
            "fine": ("closed", 1.0),
        }
        assert elapsed < 60, elapsed  # generous: a loaded machine; test_rewards.py shows what stops each bomb
    finally:
        proc.kill()
