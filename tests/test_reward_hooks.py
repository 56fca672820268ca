"""The reward webhook, reward jobs on a real rq worker, the sweeper and AIR, through real gateway processes."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from conftest import REDIS_URL, ROOT, Proc, start_gateway
from reward_hooks.client import RewardRejected, post_reward
from reward_hooks.signing import sign
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL, TOOLS, rollout

SECRET = "whsec-test-" + "ab" * 16


def agent_call(gateway: Proc, rid: str, task: str = "task-r", **kw) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/tasks/{task}/rollouts/{rid}/v1", api_key=kw.pop("key", "x"),
                           max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kw)


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
        answers = list(pool.map(lambda _: httpx.post(url, json={"reward": 1, "metadata": {"judge": "test"}}),
                                range(40)))
    assert [a.status_code for a in answers] == [200] * 40
    outcomes = sorted(a.json()["outcome"] for a in answers)
    assert outcomes == ["closed"] + ["unchanged"] * 39
    assert answers[0].json()["reward"] == 1.0 and answers[0].json()["status"] == "closed"
    conflict = httpx.post(url, json={"reward": 0.5})
    assert assert_openai_error(conflict, 409)["code"] == "reward_conflict"
    stored = rollout(gateway, rid)
    assert stored["status"] == "closed" and stored["reward"] == 1.0 and stored["reward_metadata"] == {"judge": "test"}
    assert stream_entries(redis_client) == [rid]
    # the closed rollout takes no more calls: 409, nothing recorded
    with pytest.raises(openai.ConflictError):
        agent_call(gateway, rid)
    assert len(rollout(gateway, rid)["calls"]) == 1


def test_bad_reward_posts_change_nothing(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    url = f"{gateway.url}/rollouts/{rid}/reward"
    for body in (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": 1e999}', b'{"reward": "1"}',
                 b'{"reward": true}', b'{}', b'{"reward": 1, "extra": 2}', b'not json'):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert assert_openai_error(response, 422)["code"] == "validation_error", body
    assert_openai_error(httpx.post(f"{gateway.url}/rollouts/nobody/reward", json={"reward": 1}), 404)
    big = {"reward": 1, "metadata": {"x": "y" * (2 << 20)}}
    assert assert_openai_error(httpx.post(url, json=big), 413)["code"] == "payload_too_large"
    assert rollout(gateway, rid)["status"] == "open" and stream_entries(redis_client) == []


def test_intermediate_rewards(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    agent_call(gateway, rid)
    response = httpx.post(f"{gateway.url}/rollouts/{rid}/calls/1/reward", json={"reward": 0.25})
    assert response.status_code == 200 and response.json() == {"rollout_id": rid, "index": 1, "reward": 0.25}
    error = assert_openai_error(httpx.post(f"{gateway.url}/rollouts/{rid}/calls/2/reward", json={"reward": 1}), 404)
    assert error["code"] == "call_not_found"
    calls = rollout(gateway, rid)["calls"]
    assert [c["reward"] for c in calls] == [None, 0.25]
    assert rollout(gateway, rid)["status"] == "open"  # an intermediate reward does not close the episode


def test_signed_webhooks_and_api_keys(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    proc = start_gateway(tmp_path, fake_vllm.url, webhook_secret=SECRET, api_keys="agent-key-1, agent-key-2")
    try:
        rid = uuid.uuid4().hex
        with pytest.raises(openai.AuthenticationError):
            agent_call(proc, rid, key="wrong")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{proc.url}/v1", api_key="wrong").models.list()
        agent_call(proc, rid, key="agent-key-2")
        url = f"{proc.url}/rollouts/{rid}/reward"
        body = json.dumps({"reward": 1}).encode()
        unsigned = httpx.post(url, content=body, headers={"Authorization": "Bearer agent-key-2"})
        assert assert_openai_error(unsigned, 401)["code"] == "invalid_signature"  # an agent key is not enough
        wrong = httpx.post(url, content=body, headers={"X-Signature-256": sign(body, "not-the-secret")})
        assert_openai_error(wrong, 401)
        tampered = httpx.post(url, content=b'{"reward": 0}', headers={"X-Signature-256": sign(body, SECRET)})
        assert_openai_error(tampered, 401)
        assert rollout(proc, rid)["status"] == "open"
        # the CLI signs with RLGATE_WEBHOOK_SECRET
        env = {**os.environ, "RLGATE_WEBHOOK_SECRET": SECRET}
        out = subprocess.run([sys.executable, "-m", "rlgate", "reward", rid, "0.5", "--gateway-url", proc.url],
                             env=env, cwd=ROOT, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout)["outcome"] == "closed"
        # and the Python helper, which also reports rejections
        assert post_reward(proc.url, rid, 0.5, secret=SECRET)["outcome"] == "unchanged"
        with pytest.raises(RewardRejected) as rejected:
            post_reward(proc.url, rid, 0.75, secret=SECRET)
        assert rejected.value.status == 409
    finally:
        proc.kill()
    assert SECRET not in proc.log()


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
    """A real rq worker in this process, in burst mode, with the worker's settings in RLGATE_* variables."""
    env = {"RLGATE_REDIS_URL": REDIS_URL, **{f"RLGATE_{k.upper()}": v for k, v in settings.items()}}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        SimpleWorker([Queue("rlgate-rewards", connection=client, serializer=JSONSerializer)], connection=client,
                     serializer=JSONSerializer).work(burst=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_finish_runs_a_reward_job_on_a_real_worker(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="x")
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12).choices[0].message.content
    response = httpx.post(f"{gateway.url}/rollouts/{rid}/finish",
                          json={"reward_fn": "exact_match", "ground_truth": answer.upper()})
    assert response.status_code == 202 and response.json()["rollout_id"] == rid
    assert rollout(gateway, rid)["status"] == "open"
    run_worker(redis_client)
    stored = rollout(gateway, rid)
    assert stored["status"] == "closed" and stored["reward"] == 1.0
    assert stored["reward_metadata"] == {"reward_fn": "exact_match"}
    assert stream_entries(redis_client) == [rid]
    error = assert_openai_error(httpx.post(f"{gateway.url}/rollouts/{rid}/finish", json={"reward_fn": "nope"}), 422)
    assert error["param"] == "reward_fn"


def test_a_reward_job_that_keeps_raising_fails_the_episode(fake_vllm: Proc, tmp_path, redis_client: redis.Redis):
    database = tmp_path / "gold.sqlite"  # the worker's data directory is tmp_path
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    proc = start_gateway(tmp_path, fake_vllm.url, reward_job_retries="1", reward_job_backoff_s="[0]")
    try:
        rid = uuid.uuid4().hex
        agent_call(proc, rid)
        body = {"reward_fn": "sql_execution_match", "ground_truth": "SELEC broken gold", "params": {
            "db_path": "gold.sqlite"}}
        assert httpx.post(f"{proc.url}/rollouts/{rid}/finish", json=body).status_code == 202
        run_worker(redis_client, reward_data_dir=str(tmp_path))  # runs, fails, is retried at once, fails again
        stored = rollout(proc, rid)
        assert stored["status"] == "failed" and "ValueError" in stored["error"]
        assert stream_entries(redis_client) == []
        assert_openai_error(httpx.post(f"{proc.url}/rollouts/{rid}/reward", json={"reward": 1}), 409)
        queue = Queue("rlgate-rewards", connection=redis_client, serializer=JSONSerializer)
        [job_id] = queue.failed_job_registry.get_job_ids()
        assert queue.fetch_job(job_id).retries_left == 0  # it was retried before it failed the episode

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
    subprocess.run([sys.executable, "-m", "rlgate", "worker", "--burst", "true"], env=env, cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
    stored = rollout(gateway, rid)
    assert stored["status"] == "closed" and stored["reward"] == 0.0


def test_automatic_intermediate_rewards_for_failed_tool_calls(fake_vllm: Proc, tmp_path, redis_client):
    proc = start_gateway(tmp_path, fake_vllm.url, air="true", air_reward="-0.2")
    try:
        rid = uuid.uuid4().hex
        client = openai.OpenAI(base_url=f"{proc.url}/rollouts/{rid}/v1", api_key="x")
        first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
        second = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
        history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                               "content": json.dumps({"error": "division by zero"})}]
        client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=16)
        ok_history = MESSAGES + [second.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": second.choices[0].message.tool_calls[0].id,
                                  "content": "42"}]
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
        client = openai.OpenAI(base_url=f"{gateway.url}/tasks/t-exp/rollouts/{rid}/v1", api_key="x",
                               default_headers={"X-Agent-Name": "solver" if i == 0 else "critic"})
        first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
        history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                               "content": "42"}]
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
        httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": reward})
        rids.append(rid)
    agent_call(gateway, "still-open")  # open episodes are not exported

    def export(name: str, *args: str) -> tuple[dict, str]:
        path = str(tmp_path / name)
        out = subprocess.run([sys.executable, "-m", "rlgate", "export", path, *args],
                             env={**os.environ, "RLGATE_REDIS_URL": REDIS_URL}, cwd=ROOT, check=True,
                             capture_output=True, text=True)
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
        for name in ("os:system", "reward_hooks.rewards.judge:os.system", "reward_hooks.rewards.text:re.compile"):
            refused = httpx.post(f"{proc.url}/rollouts/{rid}/finish", json={"reward_fn": name})
            assert assert_openai_error(refused, 422)["param"] == "reward_fn", name
        allowed = httpx.post(f"{proc.url}/rollouts/{rid}/finish",
                             json={"reward_fn": "reward_hooks.rewards.text:f1", "ground_truth": "x"})
        assert allowed.status_code == 202
        run_worker(redis_client, reward_fn_modules='["reward_hooks.rewards"]')  # the worker checks again
        assert rollout(proc, rid)["status"] == "closed"
    finally:
        proc.kill()


def test_worker_params_keep_requests_away_from_the_workers_secrets(tmp_path):
    from reward_hooks.jobs import worker_params
    from reward_hooks.settings import RewardSettings

    settings = RewardSettings(judge_model="openai/judge", judge_api_base="http://judge.internal/v1",
                              reward_data_dir=tmp_path)
    params = worker_params({"model": "evil", "api_base": "http://attacker", "api_key": "x", "rubric": "r",
                            "timeout_s": 10_000, "db_path": "a/b.sqlite"}, settings)
    assert params == {"model": "openai/judge", "api_base": "http://judge.internal/v1", "rubric": "r",
                      "timeout_s": 60.0, "db_path": str(tmp_path.resolve() / "a/b.sqlite")}
    with pytest.raises(PermissionError):
        worker_params({"db_path": "/etc/passwd"}, settings)
    with pytest.raises(PermissionError):
        worker_params({"db_path": "x.sqlite"}, RewardSettings())


def test_inspection_hides_the_ground_truth(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    agent_call(gateway, rid)
    httpx.post(f"{gateway.url}/rollouts/{rid}/finish", json={"reward_fn": "exact_match", "ground_truth": "SECRET"})
    stored = httpx.get(f"{gateway.url}/rollouts/{rid}")
    assert stored.json()["finish"] == {"reward_fn": "exact_match"} and "SECRET" not in stored.text
