"""The reward webhook, reward jobs on a real rq worker, the sweeper and AIR, through real gateway processes."""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
import redis
from conftest import REDIS_URL, ROOT, Proc, free_port, rlgate, start_gateway
from rq import Queue
from rq.serializers import JSONSerializer
from test_gateway_errors import assert_openai_error, refusals
from test_gateway_proxy import MESSAGES, MODEL, TOOLS, rollout

from reward_hooks import signing
from reward_hooks.client import RewardRejected, post_reward
from reward_hooks.worker import work

SECRET = "whsec-test-" + "ab" * 16


def agent_call(gateway: Proc, rid: str, task: str = "task-r", **kw) -> None:
    client = openai.OpenAI(
        base_url=f"{gateway.url}/tasks/{task}/rollouts/{rid}/v1", api_key=kw.pop("key", "x"), max_retries=0
    )
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kw)


def redis_snapshot(client: redis.Redis) -> dict[bytes, tuple[bytes, bytes | None]]:
    """Every key of the test database with its type and serialized value: equal snapshots before and
    after a request show that it changed nothing. The gateway's own markers (`:epoch`, written by its
    watcher, `:health`, by /healthz, and `:sweeper`, the sweeper's lease) are left out: they change on
    their own."""
    return {
        key: (client.type(key), client.dump(key))
        for key in sorted(client.keys("*"))
        if not key.endswith((b":epoch", b":health", b":sweeper"))
    }


def stream_entries(client: redis.Redis) -> list[str]:
    return [f[b"rollout_id"].decode() for _, f in client.xrange("rlgate:episodes")]


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_reward_closes_exactly_once(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    url = f"{gateway.url}/rollouts/{rid}/reward"
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(
            pool.map(lambda _: httpx.post(url, json={"reward": 1, "metadata": {"judge": "test"}}), range(40))
        )
    assert [a.status_code for a in answers] == [200] * 40
    outcomes = sorted(a.json()["outcome"] for a in answers)
    assert outcomes == ["closed"] + ["unchanged"] * 39
    assert answers[0].json()["reward"] == 1.0 and answers[0].json()["status"] == "closed"
    conflict = httpx.post(url, json={"reward": 0.5})
    assert assert_openai_error(conflict, 409)["code"] == "reward_conflict"
    stored = rollout(gateway, rid)
    assert (
        stored["status"] == "closed"
        and stored["reward"] == 1.0
        and stored["reward_metadata"] == {"judge": "test"}
    )
    assert stream_entries(redis_client) == [rid]
    # the closed rollout takes no more calls: 409, nothing recorded
    with pytest.raises(openai.ConflictError):
        agent_call(gateway, rid)
    assert len(rollout(gateway, rid)["calls"]) == 1


def test_bad_reward_posts_change_nothing(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    url = f"{gateway.url}/rollouts/{rid}/reward"
    bad = (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": 1e999}', b'{"reward": "1"}')
    bad += (b'{"reward": true}', b"{}", b'{"reward": 1, "extra": 2}', b"not json")
    assert {error["code"] for error in refusals(url, bad, 422)} == {"validation_error"}
    assert_openai_error(httpx.post(f"{gateway.url}/rollouts/nobody/reward", json={"reward": 1}), 404)
    # an id no rollout can have: 400 invalid_id on the webhook routes (reward, call reward, fail), as on GET /rollouts/{id}
    for path, body in (("reward", {"reward": 1}), ("calls/0/reward", {"reward": 1}), ("fail", {})):
        bad = httpx.post(f"{gateway.url}/rollouts/bad%20id/{path}", json=body)
        assert assert_openai_error(bad, 400)["code"] == "invalid_id", path
    assert assert_openai_error(httpx.get(f"{gateway.url}/rollouts/bad%20id"), 400)["code"] == "invalid_id"
    big = {"reward": 1, "metadata": {"x": "y" * (2 << 20)}}
    assert assert_openai_error(httpx.post(url, json=big), 413)["code"] == "payload_too_large"
    # finite to Python, but not to a float32 learner: outside max_abs_reward (default 1e6) is refused
    before = redis_snapshot(redis_client)
    for reward in (1e308, -1e308, 1000000.5, -2e6, 10**400):
        for route in (url, f"{gateway.url}/rollouts/{rid}/calls/0/reward"):
            content = b'{"reward": %s}' % str(reward).encode()
            error = assert_openai_error(httpx.post(route, content=content), 422)
            assert (error["code"], error["param"]) in {
                ("reward_out_of_range", "reward"),
                ("validation_error", "reward"),
            }
    assert redis_snapshot(redis_client) == before
    assert rollout(gateway, rid)["status"] == "open" and stream_entries(redis_client) == []
    assert httpx.post(url, json={"reward": -1e6}).json()["reward"] == -1e6  # the bound itself is allowed


def test_intermediate_rewards(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    agent_call(gateway, rid)
    response = httpx.post(f"{gateway.url}/rollouts/{rid}/calls/1/reward", json={"reward": 0.25})
    assert response.status_code == 200 and response.json() == {"rollout_id": rid, "index": 1, "reward": 0.25}
    error = assert_openai_error(
        httpx.post(f"{gateway.url}/rollouts/{rid}/calls/2/reward", json={"reward": 1}), 404
    )
    assert error["code"] == "call_not_found"
    calls = rollout(gateway, rid)["calls"]
    assert [c["reward"] for c in calls] == [None, 0.25]
    assert rollout(gateway, rid)["status"] == "open"  # an intermediate reward does not close the episode
    # once closed, the learner may have read it: a late per-call reward is 409, not silently kept
    assert httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": 1}).status_code == 200
    before = redis_snapshot(redis_client)
    late = assert_openai_error(
        httpx.post(f"{gateway.url}/rollouts/{rid}/calls/0/reward", json={"reward": 1}), 409
    )
    assert late["code"] == "rollout_not_open" and "closed" in late["message"]
    assert redis_snapshot(redis_client) == before
    assert [c["reward"] for c in rollout(gateway, rid)["calls"]] == [None, 0.25]


def test_signed_webhooks(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(tmp_path, fake_vllm.url, webhook_secret=SECRET)
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        path = f"/rollouts/{rid}/reward"
        url = proc.url + path
        body = json.dumps({"reward": 1}).encode()
        before = redis_snapshot(redis_client)
        unsigned = httpx.post(url, content=body)
        assert assert_openai_error(unsigned, 401)["code"] == "missing_signature"
        legacy = httpx.post(
            url,
            content=body,
            headers={  # GitHub-style, the body alone: refused, and said so
                "X-Signature-256": "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
            },
        )
        error = assert_openai_error(legacy, 401)
        assert error["code"] == "legacy_signature" and "webhook-signature" in error["message"]
        wrong = httpx.post(url, content=body, headers=signing.sign("not-the-secret", "POST", path, body))
        assert assert_openai_error(wrong, 401)["code"] == "invalid_signature"
        tampered = httpx.post(url, content=b'{"reward": 0}', headers=signing.sign(SECRET, "POST", path, body))
        assert assert_openai_error(tampered, 401)["code"] == "invalid_signature"
        dotted = signing.sign(SECRET, "POST", path, body, msg_id="msg.1")  # '.' would blur the signed fields
        assert (
            assert_openai_error(httpx.post(url, content=body, headers=dotted), 401)["code"]
            == "invalid_signature"
        )
        # a minute past the 300 s either way: 301 s ahead was accepted when the request took over a second
        stale = signing.sign(SECRET, "POST", path, body, timestamp=int(time.time()) - 360)
        assert (
            assert_openai_error(httpx.post(url, content=body, headers=stale), 401)["code"]
            == "signature_expired"
        )
        ahead = signing.sign(SECRET, "POST", path, body, timestamp=int(time.time()) + 360)
        assert (
            assert_openai_error(httpx.post(url, content=body, headers=ahead), 401)["code"]
            == "signature_expired"
        )
        assert redis_snapshot(redis_client) == before
        # rotation: any v1 entry of the list may match
        good = signing.sign(SECRET, "POST", path, body)
        good[signing.SIGNATURE_HEADER] = "v1,bm90LWl0 " + good[signing.SIGNATURE_HEADER]
        assert httpx.post(url, content=body, headers=good).json()["outcome"] == "closed"
        # the CLI signs with RLGATE_WEBHOOK_SECRET (and closes another rollout)
        rid2 = uuid.uuid4().hex
        agent_call(proc, rid2)
        env = {**os.environ, "RLGATE_WEBHOOK_SECRET": SECRET}
        out = subprocess.run(
            [sys.executable, "-m", "rlgate", "reward", rid2, "0.5", "--gateway-url", proc.url],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(out.stdout)["outcome"] == "closed"
        # and the Python helper, which also reports rejections
        assert post_reward(proc.url, rid2, 0.5, secret=SECRET)["outcome"] == "unchanged"
        with pytest.raises(RewardRejected) as rejected:
            post_reward(proc.url, rid2, 0.75, secret=SECRET)
        assert rejected.value.status == 409
        with pytest.raises(RewardRejected) as unsigned_helper:
            post_reward(proc.url, rid2, 0.5)
        assert unsigned_helper.value.status == 401
        assert rollout(proc, rid)["reward"] == 1.0 and rollout(proc, rid2)["reward"] == 0.5
    finally:
        proc.kill()
    assert SECRET not in proc.log()


def test_agent_keys_do_not_open_the_reward_routes(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(
        tmp_path,
        fake_vllm.url,
        webhook_secret=SECRET,
        api_keys="agent-key-1, agent-key-2",
        operator_token="op-" + "cd" * 16,
    )
    try:
        rid = uuid.uuid4().hex
        with pytest.raises(openai.AuthenticationError):
            agent_call(proc, rid, key="wrong")
        agent_call(proc, rid, key="agent-key-2")
        before = redis_snapshot(redis_client)
        for route, body in (
            (f"/rollouts/{rid}/reward", {"reward": 1}),
            (f"/rollouts/{rid}/calls/0/reward", {"reward": 1}),
            (f"/rollouts/{rid}/fail", {}),
            (f"/rollouts/{rid}/finish", {"reward_fn": "f1", "ground_truth": "x"}),
        ):
            refused = httpx.post(proc.url + route, json=body, headers={"Authorization": "Bearer agent-key-2"})
            assert assert_openai_error(refused, 403)["code"] == "wrong_credential", route  # docs/security.md
        assert redis_snapshot(redis_client) == before
        # the operator token opens them without a signature
        operator = {"Authorization": "Bearer op-" + "cd" * 16}
        assert (
            httpx.post(f"{proc.url}/rollouts/{rid}/reward", json={"reward": 0.5}, headers=operator).json()[
                "outcome"
            ]
            == "closed"
        )
    finally:
        proc.kill()


def test_expiry_by_the_gateways_sweeper(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(tmp_path, fake_vllm.url, rollout_ttl_s="0.3", sweep_interval_s="0.1")
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        wait_for(lambda: rollout(proc, rid)["status"] == "expired")
        gone = assert_openai_error(httpx.post(f"{proc.url}/rollouts/{rid}/reward", json={"reward": 1}), 410)
        assert gone["code"] == "rollout_expired"
        with pytest.raises(openai.ConflictError):
            agent_call(proc, rid)
        assert stream_entries(redis_client) == []
    finally:
        proc.kill()


def run_worker(client: redis.Redis, **settings: str) -> None:
    """Our reward worker's loop (`reward_hooks.worker.work`, as `rlgate worker --burst --no-fork` runs it:
    rq's SimpleWorker) in this process, with the worker's settings in RLGATE_* variables. (rq's worker
    itself sometimes takes a minute to exit a burst under load: its listener thread's race, which ours
    closes.)"""
    env = {"RLGATE_REDIS_URL": REDIS_URL, **{f"RLGATE_{k.upper()}": v for k, v in settings.items()}}
    saved = {k: os.environ.get(k) for k in env}
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    os.environ.update(env)
    try:
        work(client, "rlgate-rewards", fork=False, burst=True, abandoned_check_s=15)
    finally:
        for signum, handler in handlers.items():  # the loop's own stop handlers
            signal.signal(signum, handler)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_finish_runs_a_reward_job_on_a_real_worker(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="x")
    answer = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
        .choices[0]
        .message.content
    )
    response = httpx.post(
        f"{gateway.url}/rollouts/{rid}/finish",
        json={"reward_fn": "exact_match", "ground_truth": answer.upper()},
    )
    assert response.status_code == 202 and response.json()["rollout_id"] == rid
    assert rollout(gateway, rid)["status"] == "open"
    run_worker(redis_client)
    stored = rollout(gateway, rid)
    assert stored["status"] == "closed" and stored["reward"] == 1.0
    assert stored["reward_metadata"] == {"reward_fn": "exact_match"}
    assert stream_entries(redis_client) == [rid]
    error = assert_openai_error(
        httpx.post(f"{gateway.url}/rollouts/{rid}/finish", json={"reward_fn": "nope"}), 422
    )
    assert error["param"] == "reward_fn"


def test_a_ground_truth_without_a_number_fails_the_reward_job_at_once(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    """`math_answer` against the ground truth "nan": the same input fails the same way again, so the job is
    not retried (it was, for about 40 s, with the default retries and backoff)."""
    proc = start_gateway(tmp_path, fake_vllm.url, reward_job_retries="3", reward_job_backoff_s="[30]")
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        body = {"reward_fn": "math_answer", "ground_truth": "nan"}
        assert httpx.post(f"{proc.url}/rollouts/{rid}/finish", json=body).status_code == 202
        run_worker(redis_client)
        stored = rollout(proc, rid)
        assert stored["status"] == "failed", stored
        assert stored["error"] == "RewardInputError: ground_truth has no number: 'nan'"
        queue = Queue("rlgate-rewards", connection=redis_client, serializer=JSONSerializer)
        [job_id] = queue.failed_job_registry.get_job_ids()
        assert queue.fetch_job(job_id).retries_left == 0
    finally:
        proc.kill()


def test_a_reward_job_that_keeps_raising_fails_the_episode(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    database = tmp_path / "gold.sqlite"  # the worker's data directory is tmp_path
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    proc = start_gateway(tmp_path, fake_vllm.url, reward_job_retries="1", reward_job_backoff_s="[0]")
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        body = {
            "reward_fn": "sql_execution_match",
            "ground_truth": "SELEC broken gold",
            "params": {"db_path": "gold.sqlite"},
        }
        assert httpx.post(f"{proc.url}/rollouts/{rid}/finish", json=body).status_code == 202
        run_worker(redis_client, reward_data_dir=str(tmp_path))  # a broken gold query: fails, not retried
        stored = rollout(proc, rid)
        assert stored["status"] == "failed" and stored["error"].startswith(
            "RewardInputError: the gold SQL failed"
        )
        assert stream_entries(redis_client) == []
        assert_openai_error(httpx.post(f"{proc.url}/rollouts/{rid}/reward", json={"reward": 1}), 409)
        queue = Queue("rlgate-rewards", connection=redis_client, serializer=JSONSerializer)
        [job_id] = queue.failed_job_registry.get_job_ids()
        assert queue.fetch_job(job_id).retries_left == 0  # done: a retry would fail the same way

        # a file outside the worker's data directory: refused at once, no retry
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        body["params"]["db_path"] = "../../etc/passwd"
        httpx.post(f"{proc.url}/rollouts/{rid}/finish", json=body)
        run_worker(redis_client, reward_data_dir=str(tmp_path))
        stored = rollout(proc, rid)
        assert stored["status"] == "failed" and stored["error"].startswith("PermissionError")
    finally:
        proc.kill()


def test_rlgate_worker_command(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    httpx.post(f"{gateway.url}/rollouts/{rid}/finish", json={"reward_fn": "f1", "ground_truth": "zzz"})
    env = {**os.environ, "RLGATE_REDIS_URL": REDIS_URL}
    subprocess.run(
        [sys.executable, "-m", "rlgate", "worker", "--burst", "true"],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    stored = rollout(gateway, rid)
    assert stored["status"] == "closed" and stored["reward"] == 0.0


def test_the_worker_runs_its_jobs_with_its_own_flags(gateway: Proc, redis_client: redis.Redis):
    """A flag of `rlgate worker` reaches the reward job (run in a forked work horse): with
    --max-abs-reward 0.5 a reward of 1.0 fails the episode instead of closing it."""
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    answer = rollout(gateway, rid)["calls"][0]["response"]["message"]["content"]
    assert answer
    finish = {"reward_fn": "f1", "ground_truth": answer}  # its own answer: f1 is 1.0
    assert httpx.post(f"{gateway.url}/rollouts/{rid}/finish", json=finish).status_code == 202
    subprocess.run(
        [sys.executable, "-m", "rlgate", "worker", "--burst", "true", "--max-abs-reward", "0.5"],
        env={**os.environ, "RLGATE_REDIS_URL": REDIS_URL},
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    stored = rollout(gateway, rid)
    assert stored["status"] == "failed" and "0.5" in stored["error"], stored


def test_automatic_intermediate_rewards_for_failed_tool_calls(fake_vllm: Proc, tmp_path, redis_client):
    proc = start_gateway(tmp_path, fake_vllm.url, air="true", air_reward="-0.2")
    try:
        rid = uuid.uuid4().hex
        client = openai.OpenAI(base_url=f"{proc.url}/rollouts/{rid}/v1", api_key="x")
        first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
        second = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
        history = MESSAGES + [
            first.choices[0].message.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": first.choices[0].message.tool_calls[0].id,
                "content": json.dumps({"error": "division by zero"}),
            },
        ]
        client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=16)
        ok_history = MESSAGES + [
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": second.choices[0].message.tool_calls[0].id, "content": "42"},
        ]
        client.chat.completions.create(model=MODEL, messages=ok_history, tools=TOOLS, max_tokens=16)
        calls = wait_for(lambda: (c := rollout(proc, rid)["calls"]) and c[0]["air_reward"] is not None and c)
        assert [c["air_reward"] for c in calls] == [-0.2, None, None, None]
        assert all(c["reward"] is None for c in calls)  # kept apart from webhook rewards
        # a call refused because the episode is closed gives no automatic reward either
        httpx.post(f"{proc.url}/rollouts/{rid}/reward", json={"reward": 1})
        ok_history[-1]["content"] = "Error: timeout"
        with pytest.raises(openai.ConflictError):
            client.chat.completions.create(model=MODEL, messages=ok_history, tools=TOOLS, max_tokens=16)
        time.sleep(0.3)
        assert [c["air_reward"] for c in rollout(proc, rid)["calls"]] == [-0.2, None, None, None]
    finally:
        proc.kill()


def test_export_loads_with_datasets(gateway: Proc, tmp_path, redis_client: redis.Redis):
    import datasets

    rids = []
    for i, reward in enumerate((1.0, 0.0)):
        rid = f"export-{i}-{uuid.uuid4().hex[:6]}"
        client = openai.OpenAI(
            base_url=f"{gateway.url}/tasks/t-exp/rollouts/{rid}/v1",
            api_key="x",
            default_headers={"X-Agent-Name": "solver" if i == 0 else "critic"},
        )
        first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
        history = MESSAGES + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "42"},
        ]
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
        httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": reward})
        rids.append(rid)
    agent_call(gateway, "still-open")  # open episodes are not exported

    def export(name: str, *args: str) -> tuple[dict, str]:
        path = str(tmp_path / name)
        out = subprocess.run(
            [sys.executable, "-m", "rlgate", "export", path, *args],
            env={**os.environ, "RLGATE_REDIS_URL": REDIS_URL},
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(out.stdout), path

    summary, path = export("all.jsonl")
    rows = datasets.load_dataset("json", data_files=path, split="train")
    assert summary["rows"] == 4 and len(rows) == 4
    assert sorted(set(rows["rollout_id"])) == sorted(rids)
    stored = rollout(gateway, rids[0])["calls"]
    row = next(r for r in rows if r["rollout_id"] == rids[0] and r["index"] == 1)
    assert row["prompt_token_ids"] == stored[1]["prompt_token_ids"]
    assert row["completion_token_ids"] == stored[1]["completion_token_ids"]
    assert row["reward"] == 1.0 and row["agent_name"] == "solver" and row["task_id"] == "t-exp"

    summary, path = export("good.parquet", "--format", "parquet", "--min-reward", "0.5")
    table = datasets.load_dataset("parquet", data_files=path, split="train")
    assert summary["rows"] == 2 and set(table["rollout_id"]) == {rids[0]}
    assert json.loads(table[0]["messages"])[1]["content"] == MESSAGES[1]["content"]

    summary, path = export("critic.sft.jsonl", "--format", "sft", "--agent", "critic")
    sft = datasets.load_dataset("json", data_files=path, split="train")
    assert summary["rows"] == 2 and set(sft["rollout_id"]) == {rids[1]}
    assert sft[0]["messages"][-1]["role"] == "assistant" and sft[0]["messages"][0] == MESSAGES[0]


def test_dotted_reward_functions_only_from_allowed_modules(fake_vllm: Proc, tmp_path, redis_client):
    proc = start_gateway(tmp_path, fake_vllm.url, reward_fn_modules='["reward_hooks.rewards"]')
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        for name in (
            "os:system",
            "reward_hooks.rewards.judge:os.system",
            "reward_hooks.rewards.text:re.compile",
        ):
            refused = httpx.post(f"{proc.url}/rollouts/{rid}/finish", json={"reward_fn": name})
            assert assert_openai_error(refused, 422)["param"] == "reward_fn", name
        allowed = httpx.post(
            f"{proc.url}/rollouts/{rid}/finish",
            json={"reward_fn": "reward_hooks.rewards.text:f1", "ground_truth": "x"},
        )
        assert allowed.status_code == 202
        run_worker(redis_client, reward_fn_modules='["reward_hooks.rewards"]')  # the worker checks again
        assert rollout(proc, rid)["status"] == "closed"
    finally:
        proc.kill()


def test_worker_params_keep_requests_away_from_the_workers_secrets(tmp_path):
    from reward_hooks.jobs import worker_params
    from reward_hooks.settings import RewardSettings

    settings = RewardSettings(
        judge_model="openai/judge", judge_api_base="http://judge.internal/v1", reward_data_dir=tmp_path
    )
    params = worker_params(
        {
            "model": "evil",
            "api_base": "http://attacker",
            "api_key": "x",
            "rubric": "r",
            "timeout_s": 10_000,
            "db_path": "a/b.sqlite",
        },
        settings,
    )
    assert params == {
        "model": "openai/judge",
        "api_base": "http://judge.internal/v1",
        "rubric": "r",
        "timeout_s": 60.0,
        "db_path": str(tmp_path.resolve() / "a/b.sqlite"),
    }
    with pytest.raises(PermissionError):
        worker_params({"db_path": "/etc/passwd"}, settings)
    with pytest.raises(PermissionError):
        worker_params({"db_path": "x.sqlite"}, RewardSettings())


def test_inspection_hides_the_ground_truth(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    httpx.post(
        f"{gateway.url}/rollouts/{rid}/finish", json={"reward_fn": "exact_match", "ground_truth": "SECRET"}
    )
    stored = httpx.get(f"{gateway.url}/rollouts/{rid}")
    assert stored.json()["finish"] == {"reward_fn": "exact_match"} and "SECRET" not in stored.text


def test_the_fill_reward_must_lie_in_the_reward_range():
    from reward_hooks.settings import RewardSettings

    with pytest.raises(ValueError, match="expired_fill_reward"):
        RewardSettings(expired_fill_reward=2e6)
    assert RewardSettings(expired_fill_reward=-1.0, max_abs_reward=1.0).expired_fill_reward == -1.0


@pytest.mark.parametrize("secret", ["", "fifteen-chars!!"])
def test_an_empty_or_short_webhook_secret_is_refused_at_startup(secret, tmp_path):
    """Anyone can sign with an empty HMAC key. The gateway refuses to start, naming the setting and not
    the secret."""
    from reward_hooks.auth import WebhookAuth
    from reward_hooks.settings import RewardSettings

    with pytest.raises(ValueError, match="at least 16 characters"):
        WebhookAuth(RewardSettings(webhook_secret=secret))
    WebhookAuth(RewardSettings(webhook_secret="sixteen-chars!!!"))  # 16 is enough
    env = {
        **os.environ,
        "RLGATE_WEBHOOK_SECRET": secret,
        "RLGATE_REDIS_URL": REDIS_URL,
        "RLGATE_PORT": str(free_port()),
    }
    started = rlgate("gateway", env=env, timeout=60)
    assert started.returncode != 0
    assert "webhook_secret (RLGATE_WEBHOOK_SECRET) must be at least 16 characters" in started.stderr
    assert not secret or secret not in started.stderr + started.stdout


def test_reward_job_retries_may_not_be_negative():
    from reward_hooks.settings import RewardSettings

    with pytest.raises(ValueError, match="reward_job_retries"):
        RewardSettings(reward_job_retries=-1)
    assert RewardSettings(reward_job_retries=0).reward_job_retries == 0
