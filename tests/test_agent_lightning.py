"""Agent Lightning 1.x's agents run unchanged against rlgate: its proxy URLs (rollout, attempt, mode), its
event route and body, its bearer key, `model="auto"`, `token_ids` in the answer, attempts as episodes of
their own, validation rollouts never trained on. The agent is ours, written as Agent Lightning's example
agents are (`examples/agent_lightning_style_agent.py`), run as a real process against the gateway in front
of `rlgate serve` (a real tiny model); the harness plays Agent Lightning's controller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import ROOT, Proc, free_port, start_gateway
from test_gateway_errors import assert_openai_error

OPERATOR = "op-" + "a1" * 16
ROLLOUT_SECRET = "rks-" + "b2" * 16
OP = {"Authorization": f"Bearer {OPERATOR}"}


def start_agl_gateway(tmp_path, upstream: Proc, **settings: str) -> Proc:
    """A gateway as Agent Lightning's agents meet it: each rollout's own key required, agent rewards on,
    `model="auto"` the upstream's fake-model; `settings` on top."""
    return start_gateway(
        tmp_path,
        upstream.url,
        operator_token=OPERATOR,
        rollout_key_secret=ROLLOUT_SECRET,
        require_rollout_keys="true",
        model_aliases='{"auto": "fake-model"}',
        agent_rewards="true",
        **settings,
    )


@pytest.fixture(scope="module")
def agl_gateway(rlgate_serve: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_agl_gateway(tmp_path_factory.mktemp("agl"), rlgate_serve)
    yield proc
    proc.kill(signal.SIGTERM)


def create(gateway: Proc, **body) -> dict:
    response = httpx.post(f"{gateway.url}/rollouts", json=body, headers=OP)
    assert response.status_code == 201, response.text
    return response.json()


def read(gateway: Proc, rollout_id: str) -> dict:
    response = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", headers=OP)
    assert response.status_code == 200, response.text
    return response.json()


def run_agent(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    # the agent sees only what Agent Lightning's controller gives it (no OPENAI_* of this shell)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AGL_", "RLGATE_"))}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_lightning_style_agent.py")],
        env={**base, **env, "QUESTION": "Say hello.", "ANSWER": "e", **extra},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("style", ["chat", "completion"])
def test_an_agent_lightning_agent_runs_unchanged(
    style: str, agl_gateway: Proc, rlgate_serve: Proc, redis_client
):
    created = create(agl_gateway, task_id="hello-1")
    env = created["agent_env"]
    assert (
        env["AGL_KEY"].startswith("rk-") and "/attempt/0/mode/train/openai/v1" in env["AGL_OPENAI_BASE_URL"]
    )
    extra = {"AGENT_STYLE": style}
    if style == "completion":
        extra["AGENT_TOKENIZER"] = str(next(p for p in _model_dirs(rlgate_serve)))
    result = run_agent(env, **extra)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rollout = read(agl_gateway, created["rollout_id"])
    assert rollout["status"] == "closed" and rollout["reward"] == out["reward"]
    assert rollout["task_id"] == "hello-1" and rollout["mode"] == "train"
    assert rollout["reward_metadata"] == {"source": "agent_event"}
    [call] = rollout["calls"]
    assert call["request"]["model"] == "auto" and call["model"] == "fake-model"  # both names
    assert call["prompt_token_ids"] and call["completion_token_ids"]
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"])
    if style == "completion":
        assert call["request"]["prompt"] == call["prompt_token_ids"]  # the agent's own ids, as sent


def _model_dirs(serve: Proc) -> Iterator[str]:
    """The tiny model's folder, from the server's command line (the agent tokenizes with it)."""
    args = serve.process.args
    yield args[args.index("--model") + 1]


def test_a_failed_attempt_is_failed_and_its_retry_is_an_episode_of_its_own(agl_gateway: Proc, redis_client):
    created = create(agl_gateway, task_id="hello-2")
    rid, env = created["rollout_id"], created["agent_env"]
    failed = run_agent(env, AGENT_MAX_TOKENS="0")  # the server refuses max_tokens 0: the agent exits 1
    assert failed.returncode == 1 and "BadRequestError" in failed.stderr
    # the harness (Agent Lightning's controller) sees the exit status and fails the attempt
    assert (
        httpx.post(
            f"{agl_gateway.url}/rollouts/{rid}/fail", json={"reason": "agent exited 1"}, headers=OP
        ).status_code
        == 200
    )
    retry = {k: v.replace("/attempt/0/", "/attempt/1/") for k, v in env.items()}
    result = run_agent(retry)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read(agl_gateway, rid)["status"] == "failed"
    episode = read(agl_gateway, f"{rid}~1")
    assert episode["status"] == "closed" and episode["task_id"] == "hello-2" and len(episode["calls"]) == 1
    assert episode["reward_metadata"] == {"source": "agent_event"}
    # the rollout's key opens its attempts, and no other rollout's
    other = create(agl_gateway, task_id="hello-3")
    response = httpx.post(
        f"{agl_gateway.url}/proxy/rollout/{other['rollout_id']}/attempt/0/mode/train/openai/v1"
        "/chat/completions",
        headers={"Authorization": f"Bearer {env['AGL_KEY']}"},
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert assert_openai_error(response, 403)["code"] == "rollout_key_mismatch"
    assert read(agl_gateway, other["rollout_id"])["calls"] == []


def test_validation_rollouts_are_recorded_scored_and_marked(agl_gateway: Proc, redis_client):
    created = create(agl_gateway, task_id="hello-4", mode="val")
    env = created["agent_env"]
    assert "/mode/val/openai/v1" in env["AGL_OPENAI_BASE_URL"]
    result = run_agent(env)
    assert result.returncode == 0, result.stderr[-3000:]
    rid = created["rollout_id"]
    assert read(agl_gateway, rid)["mode"] == "val"
    entries = redis_client.xrange("rlgate:episodes")
    [entry] = [fields for _, fields in entries if fields[b"rollout_id"] == rid.encode()]
    assert entry[b"mode"] == b"val"
    # a train URL into a validation rollout (or the other way) is refused, nothing recorded
    train_url = env["AGL_OPENAI_BASE_URL"].replace("/mode/val/", "/mode/train/")
    other = create(agl_gateway, task_id="hello-4", mode="val")
    response = httpx.post(
        train_url.replace(rid, other["rollout_id"]) + "/chat/completions",
        headers={"Authorization": f"Bearer {other['api_key']}"},
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert assert_openai_error(response, 409)["code"] == "mode_mismatch"
    assert read(agl_gateway, other["rollout_id"])["calls"] == []


def test_the_event_route(agl_gateway: Proc, rlgate_serve: Proc, tmp_path, redis_client):
    created = create(agl_gateway, task_id="hello-5")
    rid, key = created["rollout_id"], created["api_key"]
    url = created["agent_env"]["AGL_EVENT_URL"]
    # other events are kept with the episode; x-api-key works as Bearer does
    answer = httpx.post(
        url, json={"event_type": "agent_output", "data": {"patch": "diff"}}, headers={"x-api-key": key}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["event_type"], body["rollout_id"], body["attempt_id"], body["data"]) == (
        "agent_output",
        rid,
        "0",
        {"patch": "diff"},
    )
    events = read(agl_gateway, rid)["events"]
    assert [(e["event_type"], e["data"]) for e in events] == [("agent_output", {"patch": "diff"})]
    # bad input: 4xx in the OpenAI shape, nothing changed
    for bad, status in (
        ({"event_type": "reward", "data": {"value": 1e308}}, 422),
        ({"event_type": "reward", "data": {"value": "high"}}, 422),
        ({"event_type": "reward", "data": {}}, 422),
        ({"event_type": "", "data": {}}, 422),
        ({"event_type": "x", "data": {"big": "a" * 20_000}}, 422),
    ):
        assert_openai_error(httpx.post(url, json=bad, headers={"Authorization": f"Bearer {key}"}), status)
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": f"Bearer {create(agl_gateway)['api_key']}"},
    ):
        response = httpx.post(url, json={"event_type": "reward", "data": {"value": 1.0}}, headers=headers)
        assert response.status_code in (401, 403), (headers, response.text)
    assert read(agl_gateway, rid)["status"] == "open"
    assert (
        httpx.post(
            url,
            json={"event_type": "reward", "data": {"value": 0.5}},
            headers={"Authorization": f"Bearer {key}"},
        ).status_code
        == 200
    )
    closed = read(agl_gateway, rid)
    assert closed["status"] == "closed" and closed["reward"] == 0.5
    # once closed: the same reward again is fine (exactly once), another one is a conflict
    again = httpx.post(
        url,
        json={"event_type": "reward", "data": {"value": 0.25}},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert assert_openai_error(again, 409)["code"] == "reward_conflict"

    # without agent_rewards an agent's own reward is refused; the operator's is taken
    gateway = start_gateway(
        tmp_path, rlgate_serve.url, operator_token=OPERATOR, rollout_key_secret=ROLLOUT_SECRET
    )
    try:
        created = create(gateway)
        url = created["agent_env"]["AGL_EVENT_URL"]
        refused = httpx.post(
            url,
            json={"event_type": "reward", "data": {"value": 1.0}},
            headers={"Authorization": f"Bearer {created['api_key']}"},
        )
        assert assert_openai_error(refused, 403)["code"] == "agent_rewards_off"
        assert read(gateway, created["rollout_id"])["status"] == "open"
        assert (
            httpx.post(url, json={"event_type": "reward", "data": {"value": 1.0}}, headers=OP).status_code
            == 200
        )
        assert read(gateway, created["rollout_id"])["status"] == "closed"
    finally:
        gateway.kill()


def test_model_aliases_and_kept_token_ids_on_the_plain_routes(fake_vllm: Proc, tmp_path, redis_client):
    from test_gateway_proxy import MESSAGES, MODEL

    gateway = start_gateway(
        tmp_path, fake_vllm.url, model_aliases=json.dumps({"auto": MODEL, "gpt-4o": MODEL})
    )
    try:
        rid = uuid.uuid4().hex
        url = f"{gateway.url}/rollouts/{rid}/v1/chat/completions"
        plain = httpx.post(url, json={"model": "auto", "messages": MESSAGES, "max_tokens": 4}).json()
        assert (
            plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
        )  # as vLLM unasked
        assert plain["model"] == MODEL
        kept = httpx.post(
            url,
            json={"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 4},
            headers={"X-Rlgate-Keep-Token-Ids": "true"},
        ).json()
        assert kept["prompt_token_ids"] and kept["choices"][0]["token_ids"]
        assert kept["choices"][0]["logprobs"] is None  # only the token ids are kept
        unknown = httpx.post(url, json={"model": "other", "messages": MESSAGES, "max_tokens": 4})
        assert unknown.status_code == 404  # no alias: the upstream's own answer
        calls = httpx.get(f"{gateway.url}/rollouts/{rid}").json()["calls"]
        assert [(c["request"]["model"], c["model"]) for c in calls] == [
            ("auto", MODEL),
            ("gpt-4o", MODEL),
            ("other", "other"),
        ]
        assert calls[1]["completion_token_ids"] == kept["choices"][0]["token_ids"]
    finally:
        gateway.kill()


def test_attempts_reach_their_own_rollout_alone_and_are_bounded(fake_vllm: Proc, tmp_path, redis_client):
    """Attempt N of rollout R is the episode `R~N` (`~` is in no rollout id, so a rollout named `R.1` is
    not R's attempt); it is created only while R exists and is open or failed, with R's task and mode, at
    most `max_attempts_per_rollout` times; its reward's source is never the agent's to say."""
    control = str(free_port())
    gateway = start_agl_gateway(tmp_path, fake_vllm, max_attempts_per_rollout="2", control_port=control)
    ops = Proc(gateway.process, f"http://127.0.0.1:{control}", gateway.log_path)  # the control port
    chat = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def call(rid: str, attempt: str, key: str, mode: str = "train") -> httpx.Response:
        return httpx.post(
            f"{gateway.url}/proxy/rollout/{rid}/attempt/{attempt}/mode/{mode}/openai/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {key}"},
        )

    def event(rid: str, attempt: str, key: str, data: dict) -> httpx.Response:
        return httpx.post(
            f"{gateway.url}/api/rollouts/{rid}/attempt/{attempt}/events",
            json={"event_type": "reward", "data": data},
            headers={"Authorization": f"Bearer {key}"},
        )

    try:
        key = create(ops, rollout_id="job7", task_id="t7")["api_key"]
        create(ops, rollout_id="job7.1", task_id="other")
        assert call("job7", "1", key).status_code == 200
        assert read(ops, "job7.1")["calls"] == []  # another rollout, untouched
        attempt = read(ops, "job7~1")
        assert attempt["task_id"] == "t7" and attempt["mode"] == "train" and len(attempt["calls"]) == 1
        # the agent cannot pass its own reward off as the operator's
        assert event("job7", "1", key, {"value": 1.0, "source": "operator_grader"}).status_code == 200
        assert read(ops, "job7~1")["reward_metadata"] == {"source": "agent_event"}
        assert read(ops, "job7.1")["status"] == "open"
        # bounded: two attempts, then 409; none once the rollout is closed
        assert call("job7", "2", key).status_code == 200
        assert assert_openai_error(call("job7", "3", key), 409)["code"] == "too_many_attempts"
        assert not redis_client.exists("rlgate:rollout:{job7}~3")
        key8 = create(ops, rollout_id="job8", task_id="t8")["api_key"]
        assert event("job8", "0", key8, {"value": 0.0}).status_code == 200  # closed
        assert assert_openai_error(call("job8", "1", key8), 409)["code"] == "rollout_not_open"
        # a validation rollout's attempts are validation episodes, whatever URL they come through
        key9 = create(ops, rollout_id="job9", task_id="t9", mode="val")["api_key"]
        assert assert_openai_error(call("job9", "1", key9), 409)["code"] == "mode_mismatch"
        assert not redis_client.exists("rlgate:rollout:{job9}~1")
        assert call("job9", "1", key9, mode="val").status_code == 200
        assert read(ops, "job9~1")["mode"] == "val"
        # the plain routes never name an attempt; the operator token is not taken on the agent port
        response = httpx.post(
            f"{gateway.url}/rollouts/job7~1/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert response.status_code in (400, 403)
        refused = httpx.post(
            f"{gateway.url}/api/rollouts/job7/attempt/0/events",
            headers=OP,
            json={"event_type": "reward", "data": {"value": 1.0}},
        )
        assert assert_openai_error(refused, 403)["code"] == "wrong_credential"
        assert read(ops, "job7")["status"] == "open"
    finally:
        gateway.kill()
